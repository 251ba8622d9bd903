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
faster than float32 and halve the weights' memory; elsewhere bfloat16 is emulated and slower
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


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's instruction-set flags: the first ``flags`` (x86) or ``Features`` (Arm) line of
    Linux's /proc/cpuinfo; empty where that file does not exist or cannot be read."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


@functools.cache
def cpu_has_native_bf16(cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """Whether the CPU's flags (``cpu_flags``) include AVX512-BF16 or AMX-BF16; False where they
    cannot be read."""
    return any(flag in cpu_flags(cpuinfo) for flag in _NATIVE_BF16_FLAGS)


def available_memory_bytes(device: torch.device, meminfo: str | Path = "/proc/meminfo") -> tuple[int, int] | None:
    """(bytes available now, bytes more the system can page out) for new allocations on
    ``device``: on CUDA the free device memory and 0; on the CPU Linux's MemAvailable and
    SwapFree. None where that cannot be read."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, 0
    try:
        fields = dict(line.split(":", 1) for line in Path(meminfo).read_text().splitlines() if ":" in line)
        return _kib(fields["MemAvailable"]), _kib(fields.get("SwapFree", "0 kB"))
    except (OSError, KeyError, ValueError):
        return None


def _kib(value: str) -> int:
    return int(value.split()[0]) * 1024


def check_weights_fit(weight_bytes: int | None, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse to load weights that cannot fit (ValueError naming the sizes and what to try);
    warn when they fit only by paging out (swap)."""
    memory = available_memory_bytes(device)
    if weight_bytes is None or memory is None:
        return
    available, pageable = memory
    if weight_bytes <= available:
        return
    gib = 1 << 30
    hint = ("; try --dtype bfloat16, a quantized checkpoint (tandem quantize), or a smaller model"
            if dtype == torch.float32 else "; try a quantized checkpoint (tandem quantize) or a smaller model")
    message = (f"the weights need {weight_bytes / gib:.1f} GiB in {str(dtype).removeprefix('torch.')} but "
               f"{device} has {available / gib:.1f} GiB available")
    if weight_bytes > available + pageable:
        raise ValueError(message + hint)
    logger.warning("%s: loading will page memory out to swap (slow)%s", message, hint)
