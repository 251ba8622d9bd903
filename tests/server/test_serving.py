"""The server's merge of request streams (tandem.server.serving.merged): a request's finish is
timed, counted and logged exactly once even when its output object turns finished before its
reader has taken that last item — the order a loaded event loop produces (CI saw the finished
count miss requests that had returned)."""
from __future__ import annotations

import asyncio
import re
from types import SimpleNamespace

from tandem.async_engine import RequestStream
from tandem.outputs import CompletionOutput, RequestOutput
from tandem.server.metrics import ServerMetrics
from tandem.server.serving import merged


def output(request_id: str, tokens: list[int], finished: bool) -> RequestOutput:
    return RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=[1, 2],
                         outputs=[CompletionOutput(index=0, text="x" * len(tokens), token_ids=tokens,
                                                   finish_reason="length" if finished else None)],
                         finished=finished)


def finished_count(metrics: ServerMetrics) -> float:
    text = metrics.render().decode()
    found = re.search(r'^tandem:request_success_total\{finish_reason="length"\} (\S+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_a_finish_that_lands_before_its_reader_takes_it_is_still_counted():
    async def scenario():
        metrics = ServerMetrics()
        ctx = SimpleNamespace(metrics=metrics, log_requests=False)
        engine = SimpleNamespace(_abort=lambda request_id: None)
        stream = RequestStream(engine, "r0", None, [1, 2])
        seen = []

        async def read():
            async for index, out in merged(ctx, [stream]):
                seen.append((index, out.finished, len(out.outputs[0].token_ids)))

        reader = asyncio.ensure_future(read())
        await asyncio.sleep(0)                           # the reader and the stream's pump wait
        stream._on_output(output("r0", [5], False))      # the pump takes this and wakes the reader,
        await asyncio.sleep(0)
        stream._on_output(output("r0", [6], True))       # and this lands before the reader runs
        await asyncio.wait_for(reader, 5)
        return seen, finished_count(metrics)

    seen, count = asyncio.run(scenario())
    assert count == 1
    assert seen[-1] == (0, True, 2) and [s for s in seen if s[1]] == [seen[-1]]  # the finish once, last
