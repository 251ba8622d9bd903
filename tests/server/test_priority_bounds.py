"""The offline API holds priorities to the server's range (``server.max_abs_priority``, 1e6 by
default): the same bound, so that a priority the server refuses cannot reach the priority
scheduler through ``LLM.generate`` either. Refusals are ValueErrors naming ``priority``,
raised before anything is queued; the bounds themselves are served."""
from __future__ import annotations

import pytest

from tandem import SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=2)


@pytest.mark.parametrize("priority", [1_000_001, -1_000_001, -(10**30), 2.0, 1.5, float("nan"), True])
def test_the_offline_api_refuses_a_priority_outside_the_range(offline, priority):
    with pytest.raises(ValueError, match=r"priority must be an integer in \[-1000000, 1000000\]"):
        offline.generate(["x = 1", "y = 2"], PARAMS, priority=[0, priority])
    assert not offline.engine.scheduler.has_unfinished_requests()


def test_the_offline_api_serves_the_bounds(offline):
    outs = offline.generate(["x = 1", "y = 2"], PARAMS, priority=[1_000_000, -1_000_000])
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2]
