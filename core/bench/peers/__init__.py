"""The engines tandem's benchmarks measure against in the same run (vLLM, in a venv of its own).

Nothing imports this package but tandem.bench.cli, which hands a benchmark its peer module
(``tandem.bench.offline.Peer``, ``tandem.bench.serve.Peer``) and adds the peer's arguments to
the benchmark's. The files run by the peer's own python (``vllm_cli.py``,
``vllm_offline_driver.py``) import nothing of tandem.
"""
from __future__ import annotations

import os


def peer_env() -> dict[str, str]:
    """The environment a peer's process gets: this one's, less the OpenMP wait policy that
    ``import tandem`` set for its own threads (tandem.OMP_POLICY_SET) — a peer runs with its
    own defaults (vLLM's and llama.cpp's OpenMP threads spin between parallel regions unless told
    otherwise; made passive they sleep and wake at every one). A policy the user set stays."""
    import tandem

    env = dict(os.environ)
    if tandem.OMP_POLICY_SET:
        env.pop("OMP_WAIT_POLICY", None)
    return env
