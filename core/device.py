"""Where an engine runs and in which floating-point type: the "auto" values of ``engine.device``
and ``model.dtype`` made concrete.

``model.dtype = "auto"`` picks, from the device and the checkpoint's own dtype (config.json's
``dtype`` / ``torch_dtype``):

=========  ==============================================  ===========
device     checkpoint                                      dtype
=========  ==============================================  ===========
cuda       any                                             bfloat16
cpu        float16 or bfloat16, and the CPU has native     bfloat16
           bfloat16 math
cpu        anything else                                   float32
=========  ==============================================  ===========

Native bfloat16 math means the AVX512-BF16 or AMX-BF16 instructions: there bfloat16 matmuls run
2-3x faster than float32 and halve the weights' memory; elsewhere bfloat16 is emulated and slower
than float32, so the CPU keeps float32. A float16 checkpoint runs in bfloat16 on the CPU because
torch's CPU float16 matmuls are slower than float32 (as in vLLM's CPU backend); most float16
checkpoints today are GPTQ/AWQ ones, whose 4-bit weights lose nothing in the cast.
"""
from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

logger = logging.getLogger("tandem")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def resolve_device(name: str) -> torch.device:
    """``engine.device``: "auto" is cuda when torch sees a GPU, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: str | None = None) -> torch.dtype:
    """``model.dtype`` for ``device``; "auto" follows the table of the module docstring."""
    if name != "auto":
        return DTYPES[name]
    checkpoint_dtype = (checkpoint_dtype or "").removeprefix("torch.")
    if device.type == "cpu":
        native = checkpoint_dtype in ("float16", "bfloat16") and cpu_has_native_bf16()
        return torch.bfloat16 if native else torch.float32
    return torch.bfloat16


@functools.cache
def cpu_has_native_bf16(cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """Whether the CPU's flags (Linux's /proc/cpuinfo) include AVX512-BF16 or AMX-BF16; False
    where that file does not exist or cannot be read."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            return any(flag in flags for flag in _NATIVE_BF16_FLAGS)
    return False
