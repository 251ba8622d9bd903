"""CPU weights and KV on 2 MiB pages (Linux transparent huge pages).

Why: a decode step on the CPU streams every weight once. On 4 KiB pages that is one TLB miss
per 4 KiB read, and the hardware prefetchers stop at every page boundary; on 2 MiB pages neither
happens, and the same kernels read the same bytes measurably faster (docs/benchmarks.md, "Decode
step against its floor"). Linux backs memory with huge pages where a program asks for them
(``madvise(MADV_HUGEPAGE)``) on most distributions' default setting (``madvise``), but torch's
allocator does not ask, and a tensor smaller than 2 MiB could not fill a huge page on its own.

``HugePageArena`` hands out tensors carved one after another from anonymous mappings aligned to
2 MiB and advised as huge pages, so that many small weights share them. A mapping stays alive as
long as one of its tensors does (the tensors hold it); the arena itself is meant for one pass
(loading a model, allocating a KV pool) and dropped after it. Untouched memory at the end of a
mapping costs nothing (it is never faulted in).

``move_weights(model)`` copies a loaded CPU model's large tensors (parameters, buffers, and the
packed weights of ``tandem.models.cpu_linear``) into an arena; ``TANDEM_CPU_HUGE_PAGES=0`` or a
system without transparent huge pages (``never``, not Linux) makes every call here allocate as
torch does.
"""
from __future__ import annotations

import ctypes
import functools
import math
import mmap
import os

import torch
from torch import nn

HUGE_PAGE = 2 << 20
CHUNK_BYTES = 64 << 20
"""The least a new mapping reserves (address space; memory only as it is touched)."""
MIN_BYTES = 64 << 10
"""Smaller tensors (norm weights, biases) stay where they are: they live in the caches anyway."""
ALIGN = 64
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


@functools.cache
def available() -> bool:
    """Whether tandem asks for huge pages here: ``TANDEM_CPU_HUGE_PAGES`` not 0 and
    ``system_supports()``."""
    if os.environ.get("TANDEM_CPU_HUGE_PAGES", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return system_supports()


@functools.cache
def system_supports() -> bool:
    """Linux with transparent huge pages not set to ``never``, and ``mmap.MADV_HUGEPAGE`` known
    to Python."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open(THP_SETTING) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


class HugePageArena:
    """Tensors from 2 MiB-aligned anonymous mappings advised as huge pages (module doc). Fresh
    memory reads as zeros."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.chunk_bytes = chunk_bytes
        self._buffer: torch.Tensor | None = None  # uint8 view of the current mapping, 2 MiB aligned
        self._used = 0
        self.bytes_handed_out = 0

    def empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous CPU tensor of ``shape`` and ``dtype`` on huge pages (``torch.zeros`` where
        ``available()`` is False). Its contents are zeros."""
        if not available():
            return torch.zeros(shape, dtype=dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if self._buffer is None or self._used + nbytes > self._buffer.numel():
            self._map(max(self.chunk_bytes, nbytes))
        start = self._used
        self._used = -(-(start + nbytes) // ALIGN) * ALIGN
        self.bytes_handed_out += nbytes
        return self._buffer[start:start + nbytes].view(dtype).view(shape)

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s values in a new contiguous tensor of this arena."""
        out = self.empty(tensor.shape, tensor.dtype)
        out.copy_(tensor)
        return out

    def _map(self, nbytes: int) -> None:
        size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
        region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        address = ctypes.addressof(ctypes.c_char.from_buffer(region))
        offset = (-address) % HUGE_PAGE
        region.madvise(mmap.MADV_HUGEPAGE, offset, size)
        # the tensor holds the mapping (frombuffer keeps the buffer alive); so does every view of it
        self._buffer = torch.frombuffer(region, dtype=torch.uint8)[offset:offset + size]
        self._used = 0


def move_weights(model: nn.Module, min_bytes: int = MIN_BYTES) -> int:
    """Copy ``model``'s CPU tensors of at least ``min_bytes`` — parameters, buffers, and the
    weights of its packed linear layers — onto huge pages; a tensor reached twice (a tied LM
    head) is copied once. Returns the bytes moved (0 where ``available()`` is False)."""
    if not available():
        return 0
    from tandem.models.cpu_linear import BucketedLinear, PackedLinear

    arena = HugePageArena()
    copies: dict[tuple, torch.Tensor] = {}

    def moved(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cpu" or t.layout != torch.strided or not t.is_contiguous() \
                or t.numel() * t.element_size() < min_bytes:
            return t
        key = (t.data_ptr(), t.dtype, tuple(t.shape))
        if key not in copies:
            copies[key] = arena.copy(t)
        return copies[key]

    with torch.no_grad():
        for module in model.modules():
            for param in module.parameters(recurse=False):
                new = moved(param.data)
                if new is not param.data:
                    param.data = new
            for name, buf in list(module.named_buffers(recurse=False)):
                new = moved(buf)
                if new is not buf:
                    setattr(module, name, new)
            packed = getattr(module, "packed", None)
            if isinstance(packed, PackedLinear):
                packed.weight = moved(packed.weight)
            elif isinstance(packed, BucketedLinear):
                for p in {id(p): p for p in packed.by_bucket}.values():
                    p.weight = moved(p.weight)
    return arena.bytes_handed_out
