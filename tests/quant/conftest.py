"""The Triton kernel tests of this folder run on CUDA when there is a GPU, else in Triton's CPU
interpreter — the pattern of tests/kernels/conftest.py: ``TRITON_INTERPRET`` must be set before
triton is first imported (transformers imports it too), so it is set here, when this folder is
collected. Kernel tests take the ``kernel_device`` fixture, which fails with advice when triton
was imported for a GPU before this file ran on a CPU-only machine."""
from __future__ import annotations

import os
import sys

import pytest
import torch

_TRITON_LOADED_FOR_GPU = False
if not torch.cuda.is_available():
    _TRITON_LOADED_FOR_GPU = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def kernel_device() -> torch.device:
    if _TRITON_LOADED_FOR_GPU:
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set, so its kernels cannot run on "
                    "this CPU-only machine: set os.environ.setdefault('TRITON_INTERPRET', '1') at the top "
                    "of tests/conftest.py when torch.cuda.is_available() is False")
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
