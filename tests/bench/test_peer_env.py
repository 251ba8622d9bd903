"""The environment a benchmark's peer (vLLM, llama.cpp) runs in: the user's, not the OpenMP wait
policy ``import tandem`` sets for tandem's own threads."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = ("import os, tandem; from tandem.bench.peers import peer_env; "
         "print(os.environ.get('OMP_WAIT_POLICY'), peer_env().get('OMP_WAIT_POLICY'))")


@pytest.mark.parametrize(("given", "ours", "peers"), [(None, "PASSIVE", "None"), ("ACTIVE", "ACTIVE", "ACTIVE"),
                                                      ("PASSIVE", "PASSIVE", "PASSIVE")])
def test_peers_get_the_users_omp_wait_policy_not_tandems(given, ours, peers):
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given is not None:
        env["OMP_WAIT_POLICY"] = given
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [ours, peers]
