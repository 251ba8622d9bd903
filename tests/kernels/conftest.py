"""Kernel tests run on CUDA when there is a GPU, else in Triton's CPU interpreter.

Triton decides between compiling and interpreting when a function is *defined* (``@triton.jit``
reads ``TRITON_INTERPRET``), its own library functions (tl.max, tl.cdiv…) included, so the
variable must be set before triton is first imported in the process. It is set here, before any
test module imports tandem.kernels; on a CPU machine it then holds for the rest of the process,
which is harmless (without a GPU the interpreter is the only way a Triton kernel runs). Some
imports load triton on their own (transformers' model classes do): when a run imports one of
them before this folder is collected, the variable must be set earlier, in tests/conftest.py,
and the kernel tests fail with that advice until it is.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

_TRITON_LOADED_FOR_GPU = False
if not torch.cuda.is_available():
    _TRITON_LOADED_FOR_GPU = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def _interpreter_in_time() -> None:
    if _TRITON_LOADED_FOR_GPU:
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set, so its kernels cannot run on "
                    "this CPU-only machine: set os.environ.setdefault('TRITON_INTERPRET', '1') at the top "
                    "of tests/conftest.py when torch.cuda.is_available() is False")


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture
def gen() -> torch.Generator:
    """A fresh seeded CPU generator per test: random but reproducible inputs."""
    return torch.Generator().manual_seed(1234)
