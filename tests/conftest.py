"""Suite-wide set-up.

Triton reads TRITON_INTERPRET when it is first imported (transformers' model classes import it
during collection), so it is set here, before anything else: without a GPU the interpreter is the
only way a Triton kernel runs, and the kernel tests compare it against torch references.

The suite keeps CPU weights on 4 KiB pages (``TANDEM_CPU_HUGE_PAGES=0``, for this process and the
servers it starts; set it to 1 to run everything on tandem's default): on a virtual machine that
hands free memory back to its host, the first touch of a 2 MiB page costs seconds per GiB, which
every model load of the suite would pay. tests/models/test_huge_pages.py turns them on.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TANDEM_CPU_HUGE_PAGES", "0")


def pytest_sessionstart(session):
    """Build tandem's CPU kernels (kernels/cpu/*.cpp) once, in this process, before any test: on
    a machine without the cached build that takes ~40 s, which would otherwise fall on whichever
    test first starts an engine — often a server subprocess or a disaggregated pair racing for the
    build under a start-up timeout. A machine that cannot build them runs on torch's kernels
    (tandem logs why); the tests that need them say so."""
    from tandem.kernels import cpu_ops

    cpu_ops.load()
