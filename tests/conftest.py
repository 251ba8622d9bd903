"""Suite-wide set-up.

Triton reads TRITON_INTERPRET when it is first imported (transformers' model classes import it
during collection), so it is set here, before anything else: without a GPU the interpreter is the
only way a Triton kernel runs, and the kernel tests compare it against torch references.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
