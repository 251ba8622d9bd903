"""Suite-wide set-up.

Triton reads TRITON_INTERPRET when it is first imported (transformers' model classes import it
during collection), so it is set here, before anything else: without a GPU the interpreter is the
only way a Triton kernel runs, and the kernel tests compare it against torch references.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_sessionstart(session):
    """Build tandem's CPU kernels (kernels/cpu/*.cpp) once, in this process, before any test: on
    a machine without the cached build that takes ~40 s, which would otherwise fall on whichever
    test first starts an engine — often a server subprocess or a disaggregated pair racing for the
    build under a start-up timeout. A machine that cannot build them runs on torch's kernels
    (tandem logs why); the tests that need them say so."""
    from tandem.kernels import cpu_ops

    cpu_ops.load()
