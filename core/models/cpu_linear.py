"""Linear layers on the CPU with their weights packed once (``engine.cpu_kernels``).

Why: ``F.linear`` on a plain row-major weight uses the FMA units poorly at decode batch sizes,
and a CPU without bfloat16 instructions emulates bfloat16 GEMMs. ``pack_cpu_linears(model, mode)``
runs once after the weights are loaded and gives every unquantized ``LinearLayer`` and the LM
head a packed weight (``layer.packed``: a ``PackedLinear``, or a ``BucketedLinear`` of two),
which ``UnquantizedLinearMethod.apply`` and ``LMHead.forward`` call instead; the dense weight is
freed (the embedding keeps its table when the head is tied to it).

Kernels (``mode``):

- ``tandem``: tandem's own panels (``kernels/cpu/linear.cpp``, docs/architecture.md §11): 16-bit
  weights stay 16-bit and widen to float32 as they load, so they read half the bytes;
- ``dpbf16``: tandem's panels of bfloat16 weight pairs multiplied by AVX512-BF16's pair dot
  products (``kernels/cpu/linear_dpbf16.cpp``), for bfloat16 layers on a CPU that has them
  (other layers fall back to ``tandem``);
- ``amx``: the same panels multiplied on AMX tiles (``panel_linear_amx``, same file), for
  bfloat16 layers with K a multiple of 32 on a CPU with AMX-BF16 (other layers fall back to
  ``dpbf16``, then ``tandem``); ``dpbf16`` and ``amx`` share one packing. A float32 layer (K a
  multiple of 32) on ``amx`` keeps ``tandem``'s panels and multiplies them on the tiles as
  three bfloat16 parts a value (``panel_linear_amx_f32``: float32's precision; faster than the
  float32 FMAs only where there are many rows, so ``auto`` weighs it last);
- ``onednn``: oneDNN's reordered weights (``torch.ops.mkldnn``), in the model's dtype where the
  CPU has instructions for it, else in float32 (twice the memory of a 16-bit model);
- ``torch``: ``F.linear`` on the plain weights — the reference the tests compare against;
- ``auto``: each layer shape and batch-size bucket on the kernel measured fastest on this
  machine (``tandem.models.cpu_tuning``: how, and the cache that makes it a one-time cost).

Every kernel returns the input's dtype; the sums are float32 in all of them.
"""
from __future__ import annotations

import functools
import logging
import time
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels import cpu_ops
from tandem.models import cpu_tuning, huge_pages
from tandem.models.cpu_tuning import M_BUCKETS, Shape, ShapeChoice, bucket_index

logger = logging.getLogger("tandem")

MODES = ("auto", "tandem", "dpbf16", "amx", "onednn", "torch")
PANEL = 16
PAIR_KINDS = ("dpbf16", "amx")
"""The kernels of the bfloat16 pair panels (one packing serves both)."""


class PackedLinear:
    """One linear layer's packed weight and the call that multiplies by it:
    ``packed(x [M, K], bias [N] | None) -> [M, N]`` in ``x``'s dtype."""

    __slots__ = ("kind", "weight", "out_features", "in_features")

    def __init__(self, kind: str, weight: torch.Tensor, out_features: int, in_features: int) -> None:
        self.kind, self.weight = kind, weight
        self.out_features, self.in_features = out_features, in_features

    @classmethod
    def pack(cls, kind: str, weight: torch.Tensor) -> PackedLinear:
        """Pack ``weight`` [out, in] for ``kind`` ("tandem", "onednn", or "torch": the weight
        itself, multiplied by ``F.linear``)."""
        weight = weight.detach()
        n, k = weight.shape
        if kind == "torch":
            packed = weight
        elif kind == "tandem" or kind in PAIR_KINDS:
            if not cpu_ops.load():
                raise ValueError("tandem's CPU kernels could not be built (see the warning above)")
            panels = -(-n // PANEL)
            padded = torch.zeros(panels * PANEL, k, dtype=weight.dtype)
            padded[:n] = weight
            if kind == "tandem":
                packed = padded.view(panels, PANEL, k).transpose(1, 2).contiguous()
            else:
                assert (amx_fits if kind == "amx" else dpbf16_fits)(weight.dtype, k), (kind, weight.dtype, k)
                if weight.dtype == torch.float32:  # amx's float32 layers: tandem's panels
                    packed = padded.view(panels, PANEL, k).transpose(1, 2).contiguous()
                else:
                    packed = padded.view(panels, PANEL, k // 2, 2).transpose(1, 2).contiguous()
        else:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(onednn_dtype(weight.dtype)).contiguous(), 1)
        return cls(kind, packed, n, k)

    def copied(self, arena: huge_pages.HugePageArena) -> PackedLinear:
        """The same layer on a copy of the packed weight (in ``arena``; oneDNN's opaque tensor
        cloned)."""
        weight = self.weight.clone() if self.weight.layout != torch.strided else arena.copy(self.weight)
        return PackedLinear(self.kind, weight, self.out_features, self.in_features)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.kind == "torch":
            out = F.linear(x2 if x2.dtype == self.weight.dtype else x2.to(self.weight.dtype), self.weight,
                           None if bias is None else bias.to(self.weight.dtype))
        elif self.kind == "tandem" or self.kind in PAIR_KINDS:
            # tandem's panels read float32 rows (on AMX too); the pair kernels bfloat16 rows at an even stride
            f32_panels = self.kind == "tandem" or self.weight.dtype == torch.float32
            want = torch.float32 if f32_panels else torch.bfloat16
            # the pair kernels write a bfloat16 layer's out themselves, rounded as .to() would round it
            out_dtype = torch.bfloat16 if not f32_panels and x.dtype == torch.bfloat16 else torch.float32
            if x2.dtype != want or x2.stride(-1) != 1 or (want == torch.bfloat16 and x2.stride(0) % 2):
                x2 = x2.to(want).contiguous()
            out = torch.empty(x2.shape[0], self.out_features, dtype=out_dtype)
            if bias is not None and bias.dtype != torch.float32:
                bias = bias.float()
            kernel = {"tandem": cpu_ops.panel_linear, "dpbf16": cpu_ops.panel_linear_dpbf16,
                      "amx": cpu_ops.panel_linear_amx_f32 if f32_panels else cpu_ops.panel_linear_amx}[self.kind]
            kernel(out, x2, self.weight, bias)
        else:
            compute = self.weight.dtype
            out = torch.ops.mkldnn._linear_pointwise(
                x2 if x2.dtype == compute else x2.to(compute), self.weight,
                None if bias is None else bias.to(compute), "none", [], "")
        if out.dtype != x.dtype:
            out = out.to(x.dtype)
        return out.view(*lead, self.out_features)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """``self(x).float()``: float32 values of ``x``'s dtype (an LM head's logits, rounded as
        the model's dtype rounds them). A bfloat16 layer on dpbf16 or amx has the kernel store them
        so, without the two conversion passes (torch's pass over the vocabulary wakes its thread
        team every step)."""
        if self.kind not in PAIR_KINDS or x.dtype != torch.bfloat16 or self.weight.dtype != torch.bfloat16:
            return self(x).float()
        x2 = x.reshape(-1, self.in_features)
        if x2.stride(-1) != 1 or x2.stride(0) % 2:
            x2 = x2.contiguous()
        out = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32)
        kernel = cpu_ops.panel_linear_amx if self.kind == "amx" else cpu_ops.panel_linear_dpbf16
        kernel(out, x2, self.weight, None, bf16_values=True)
        return out.view(*x.shape[:-1], self.out_features)



SILU_PASSES = {"amx": cpu_ops.panel_linear_amx_silu, "dpbf16": cpu_ops.panel_linear_dpbf16_silu}
"""The kinds whose panels a gated MLP's product and SiLU-and-mul can take in one pass, and the
``cpu_ops`` function that does."""


def silu_pass(layer: nn.Module, rows: int) -> tuple[Callable[..., None], torch.Tensor] | None:
    """The one-pass kernel and the panels a batch of ``rows`` rows of a gated MLP's fused
    ``[gate; up]`` projection ``layer`` multiplies by, where that kernel
    (``cpu_ops.panel_linear_amx_silu`` or ``panel_linear_dpbf16_silu``) can take the product and
    SiLU-and-mul together (bfloat16, no bias, gate's outputs a multiple of 16); else None. The C++
    decode loop takes that pass on the same condition (``decode_layers.cpp``)."""
    packed = getattr(layer, "packed", None)
    if isinstance(packed, BucketedLinear):
        packed = packed.by_bucket[bucket_index(rows)]
    if (not isinstance(packed, PackedLinear) or packed.kind not in SILU_PASSES
            or packed.weight.dtype != torch.bfloat16 or getattr(layer, "bias", None) is not None
            or packed.out_features % 32):
        return None
    return SILU_PASSES[packed.kind], packed.weight


class BucketedLinear:
    """A layer that multiplies each batch with the kernel chosen for its bucket of rows
    (``cpu_tuning.bucket_index``): ``by_bucket[i]`` is one of the layer's packings."""

    __slots__ = ("by_bucket", "out_features", "in_features")

    def __init__(self, by_bucket: list[PackedLinear]) -> None:
        self.by_bucket = by_bucket
        self.out_features, self.in_features = by_bucket[0].out_features, by_bucket[0].in_features

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.numel() // self.in_features
        return self.by_bucket[bucket_index(rows)](x, bias)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """``PackedLinear.logits`` with the bucket's packing."""
        return self.by_bucket[bucket_index(x.numel() // self.in_features)].logits(x)

    @property
    def kinds(self) -> list[str]:
        return [p.kind for p in self.by_bucket]


@functools.cache
def onednn_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype oneDNN multiplies ``dtype`` weights in on this CPU: float32, or a 16-bit type
    the CPU has instructions for (tried on a tiny weight)."""
    if dtype == torch.float32:
        return dtype
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), 1)
    except RuntimeError:
        return torch.float32
    return dtype


@functools.cache
def dpbf16_available() -> bool:
    """Whether the ``dpbf16`` kernel runs here: tandem's kernels built and a CPU with AVX512-BF16."""
    return cpu_ops.load() and cpu_ops.dpbf16_supported()


def dpbf16_fits(dtype: torch.dtype, in_features: int) -> bool:
    """Whether a layer of ``dtype`` weights with ``in_features`` inputs can use ``dpbf16``."""
    return dtype == torch.bfloat16 and in_features % 2 == 0


@functools.cache
def amx_available() -> bool:
    """Whether the ``amx`` kernel runs here: tandem's kernels built, a CPU with AMX-BF16 and a
    kernel that lets the process use it."""
    return cpu_ops.load() and cpu_ops.amx_supported()


def amx_fits(dtype: torch.dtype, in_features: int) -> bool:
    """Whether a layer of ``dtype`` weights with ``in_features`` inputs can use ``amx`` (K in
    whole tiles of 32; bfloat16, or float32 split into bfloat16 parts)."""
    return dtype in (torch.bfloat16, torch.float32) and in_features % 32 == 0


def fitting_kind(kind: str, dtype: torch.dtype, in_features: int) -> str:
    """``kind``, or the kernel a layer it does not take falls back to (``amx``: ``dpbf16``, then
    ``tandem``; ``dpbf16``: ``tandem``)."""
    if kind == "amx" and not amx_fits(dtype, in_features):
        kind = "dpbf16"
    if kind == "dpbf16" and not dpbf16_fits(dtype, in_features):
        kind = "tandem"
    return kind


def resolve_kind(mode: str, device: torch.device) -> str:
    """The kernel ``mode`` stands for on ``device``: "tandem", "dpbf16", "amx", "onednn" or "torch"."""
    if mode not in MODES:
        raise ValueError(f"engine.cpu_kernels = {mode!r}; allowed: {', '.join(MODES)}")
    if device.type != "cpu" or mode == "torch":
        return "torch"
    if mode == "dpbf16":
        if not dpbf16_available():
            raise ValueError("engine.cpu_kernels = 'dpbf16' but this CPU has no AVX512-BF16 instructions "
                             "(or tandem's CPU kernels could not be built); use 'auto', 'tandem', 'onednn' "
                             "or 'torch'")
        return mode
    if mode == "amx":
        if not amx_available():
            raise ValueError("engine.cpu_kernels = 'amx' but this CPU (or its operating system) gives no AMX-BF16 "
                             "instructions (or tandem's CPU kernels could not be built); use 'auto', 'tandem', "
                             "'dpbf16', 'onednn' or 'torch'")
        return mode
    if mode in ("auto", "tandem") and cpu_ops.load():
        return "tandem"
    if mode == "tandem":
        raise ValueError("engine.cpu_kernels = 'tandem' but tandem's CPU kernels could not be built "
                         "(see the warning above); use 'auto', 'onednn' or 'torch'")
    if torch.backends.mkldnn.is_available():
        return "onednn"
    if mode == "onednn":
        raise ValueError("engine.cpu_kernels = 'onednn' but this torch build has no oneDNN (mkldnn); "
                         "use 'auto' or 'torch'")
    return "torch"


def available_kinds() -> list[str]:
    """The CPU kernels that run here, in the order of the fixed rule (the first is what
    ``auto`` meant before kernels were measured)."""
    return [k for k, ok in (("tandem", cpu_ops.load()), ("dpbf16", dpbf16_available()), ("amx", amx_available()),
                            ("onednn", torch.backends.mkldnn.is_available()), ("torch", True)) if ok]


def kinds_for(shape: Shape) -> list[str]:
    """The kernels of ``available_kinds()`` that take a layer of ``shape``, the fixed rule's first:
    ``amx``, then ``dpbf16``, where they take the layer (the CPU's own bfloat16 instructions
    rather than bfloat16 widened to float32), else the order of ``available_kinds()``."""
    kinds = [k for k in available_kinds() if k not in PAIR_KINDS]
    pairs = [k for k in ("amx", "dpbf16") if k in available_kinds() and fitting_kind(k, shape.dtype, shape.k) == k]
    if shape.dtype != torch.bfloat16:  # float32 on AMX: three products' worth of tiles, weighed last
        return [*kinds, *pairs]
    return [*pairs, *kinds]


def pack_cpu_linears(model: nn.Module, mode: str, device: torch.device, lm_head_rows: int | None = None) -> str:
    """Give every unquantized linear layer of ``model`` and its LM head the packed weight(s) of
    the kernel(s) ``mode`` resolves to (see the module doc), freeing the dense weights they
    replace. Returns that kernel's name, or "tuned" for ``auto`` ("torch": nothing packed).
    ``lm_head_rows``: the most rows the LM head multiplies in a step (``auto`` weighs only the
    batch sizes up to it in the LM head's choice; None: all)."""
    from tandem.models.layers import LinearLayer, LMHead

    if mode not in MODES:
        raise ValueError(f"engine.cpu_kernels = {mode!r}; allowed: {', '.join(MODES)}")
    layers = []
    for name, module in model.named_modules():
        if getattr(module, "packed", None) is not None:
            continue
        if isinstance(module, LinearLayer) and module.quant_method.name == "unquantized" \
                or isinstance(module, LMHead):
            layers.append((name, module))
    if mode == "auto" and device.type == "cpu" and len(available_kinds()) > 1:
        if layers:
            _pack_tuned(layers, lm_head_rows)
        return "tuned"
    kind = resolve_kind(mode, device)
    if kind == "torch":
        return kind
    dtypes = set()
    with torch.no_grad():
        for _, module in layers:
            dtypes.add(module.weight.dtype)
            _install(module, PackedLinear.pack(fitting_kind(kind, *_dtype_and_k(module)), module.weight))
    if layers:
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
        upcast = kind == "onednn" and any(onednn_dtype(d) != d for d in dtypes)
        logger.info("linear layers: %d packed for the %s CPU kernel (%s weights%s)", len(layers), kind, names,
                    ", multiplied in float32: this CPU has no instructions for them" if upcast else "")
    return kind


def _install(module: nn.Module, packed: PackedLinear | BucketedLinear) -> None:
    """``module`` multiplies by ``packed`` from now on; its dense weight goes unless it is a
    tied head's (the embedding's table)."""
    module.packed = packed
    if not getattr(module, "tied", False):
        module.weight = None


def _dtype_and_k(module: nn.Module) -> tuple[torch.dtype, int]:
    return module.weight.dtype, module.weight.shape[1]


def _layout(kind: str, dtype: torch.dtype) -> str:
    """Kernels with the same layout multiply one packing (``amx``'s float32 layers: tandem's)."""
    if kind == "amx" and dtype == torch.float32:
        return "tandem"
    return "pairs" if kind in PAIR_KINDS else kind


def _packed_bytes(kind: str, shape: Shape) -> int:
    if kind == "tandem" or kind in PAIR_KINDS:
        return -(-shape.n // PANEL) * PANEL * shape.k * shape.dtype.itemsize
    dtype = onednn_dtype(shape.dtype) if kind == "onednn" else shape.dtype
    return shape.n * shape.k * dtype.itemsize


def _pack_tuned(layers: list[tuple[str, nn.Module]], lm_head_rows: int | None = None) -> None:
    """``auto``: measure (or read from the cache) each shape's kernels, choose for the LM head's
    rows, fit second packings in the memory budget, pack, and log the choice per layer kind."""
    from tandem.models.layers import LMHead

    by_shape: dict[Shape, list[tuple[str, nn.Module]]] = defaultdict(list)
    for name, module in layers:
        by_shape[Shape(module.weight.dtype, *module.weight.shape)].append((name, module))
    t0 = time.perf_counter()
    choices, measured = _choices(by_shape)
    for shape, mods in by_shape.items():
        if lm_head_rows is not None and all(isinstance(m, LMHead) for _, m in mods):
            choices[shape] = cpu_tuning.choose(choices[shape].seconds, kinds_for(shape)[0], lm_head_rows)
    seconds = time.perf_counter() - t0
    source = {None: "the CPU was busy: not measured", 0: "all from the cache"}.get(
        measured, f"measured {measured} shape(s) in {seconds:.1f} s")
    extra = {}
    for shape, mods in by_shape.items():
        for kind in choices[shape].kinds[1:]:
            shared = _layout(kind, shape.dtype) == _layout(choices[shape].primary, shape.dtype)
            extra[(shape, kind)] = sum(0 if shared or kind == "torch" and getattr(m, "tied", False)
                                       else _packed_bytes(kind, shape) for _, m in mods)
    primary_bytes = sum(_packed_bytes(choices[s].primary, s) * len(m) for s, m in by_shape.items())
    choices = cpu_tuning.within_budget(choices, extra, int(primary_bytes * cpu_tuning.EXTRA_BYTES_SHARE))
    with torch.no_grad():
        for shape, mods in by_shape.items():
            choice = choices[shape]
            for _, module in mods:
                layouts: dict[str, PackedLinear] = {}
                packings = {}
                for k in choice.kinds:
                    layout = _layout(k, shape.dtype)
                    if layout not in layouts:
                        layouts[layout] = PackedLinear.pack(k, module.weight)
                    same = layouts[layout]
                    packings[k] = PackedLinear(k, same.weight, same.out_features, same.in_features)
                packed = packings[choice.primary] if len(packings) == 1 else \
                    BucketedLinear([packings[k] for k in choice.buckets])
                _install(module, packed)
    logger.info("linear layers: %d on the kernels measured fastest here (%s; %s)", len(layers), source,
                cpu_tuning.cache_path(cpu_tuning.machine_key()))
    for line in describe(by_shape, choices):
        logger.info("  %s", line)


def _choices(by_shape: dict[Shape, list[tuple[str, nn.Module]]]) -> tuple[dict[Shape, ShapeChoice], int | None]:
    """Each shape's choice from the cache, measuring (under the cache's lock) those it lacks —
    or, on a machine other processes keep busy, the fixed rule's kernel for them, uncached;
    returns the choices and how many shapes were measured (None: the CPU was busy)."""
    key = cpu_tuning.machine_key()
    path = cpu_tuning.cache_path(key)
    with cpu_tuning.locked(path):
        cached = cpu_tuning.read_cache(path)
        missing = [s for s in by_shape
                   if s.key not in cached or not set(cached[s.key].seconds) >= set(kinds_for(s))]
        if not missing:
            return {s: cached[s.key] for s in by_shape}, 0
        busy = cpu_tuning.machine_is_busy()
        if busy is None:
            meter = cpu_tuning.CpuMeter()
            measured = {s: _measure(s, by_shape[s][0][1].weight, kinds_for(s)) for s in missing}
            for s, choice in measured.items():  # a kernel other than the fixed rule's: timed again
                again = cpu_tuning.to_confirm(choice, kinds_for(s)[0])
                if again:
                    measured[s] = _measure(s, by_shape[s][0][1].weight, kinds_for(s), again, choice.seconds)
            busy = meter.others_share()
            if busy <= cpu_tuning.BUSY_SHARE:
                cached.update((s.key, c) for s, c in measured.items())
                cpu_tuning.write_cache(path, key, cached)
                return {s: cached[s.key] for s in by_shape}, len(missing)
    fixed = {s: kinds_for(s)[0] for s in missing}
    logger.warning("linear layers: other processes used %.0f%% of the CPUs while tandem meant to time "
                   "its kernels; the fixed rule's kernel (%s) for the %d shape(s) not measured yet, "
                   "measured again at the next start", busy * 100, ", ".join(sorted(set(fixed.values()))),
                   len(missing))
    return {s: ShapeChoice(fixed[s], (fixed[s],) * len(M_BUCKETS), {fixed[s]: [1.0] * len(M_BUCKETS)})
            if s in missing else cached[s.key] for s in by_shape}, None


def _measure(shape: Shape, weight: torch.Tensor, kinds: list[str], buckets: list[int] | None = None,
             earlier: dict[str, list[float]] | None = None) -> ShapeChoice:
    """``shape``'s choice among ``kinds`` (the fixed rule's first) from its timings: of every
    bucket, or of ``buckets`` only, merged with the ``earlier`` pass's (``cpu_tuning.merged``)."""
    arena = huge_pages.HugePageArena()
    candidates = {}
    for k in kinds:
        packed = PackedLinear.pack(k, weight)
        copies = cpu_tuning.num_copies(_packed_bytes(k, shape))
        candidates[k] = cpu_tuning.Rotation([packed, *(packed.copied(arena) for _ in range(copies - 1))])
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(m, shape.k, generator=gen).to(shape.dtype) for m in M_BUCKETS]
    with torch.inference_mode():
        if buckets is None:
            seconds = cpu_tuning.measure(candidates, inputs, before=cpu_tuning.pool_job())
        else:
            later = cpu_tuning.measure(candidates, [inputs[i] for i in buckets], before=cpu_tuning.pool_job())
            seconds = cpu_tuning.merged(earlier, later, buckets)
        return cpu_tuning.choose(seconds, kinds[0])


def describe(by_shape: dict[Shape, list[tuple[str, nn.Module]]], choices: dict[Shape, ShapeChoice]) -> list[str]:
    """One line per layer kind (the last part of its module name) and shape: its kernel per
    bucket of rows, e.g. "qkv_proj 576→960 bfloat16 ×30: tandem (M ≥ 2), torch (M = 1)"."""
    lines = []
    for shape, mods in by_shape.items():
        kinds = defaultdict(int)
        for name, _ in mods:
            kinds[name.rsplit(".", 1)[-1]] += 1
        buckets = choices[shape].buckets
        spans = []
        for kind in dict.fromkeys(buckets):
            ms = [M_BUCKETS[i] for i, b in enumerate(buckets) if b == kind]
            spans.append(kind if len(ms) == len(M_BUCKETS) else f"{kind} (M ≈ {', '.join(map(str, ms))})")
        for layer_kind, count in kinds.items():
            lines.append(f"{layer_kind} {shape.k}→{shape.n} {str(shape.dtype).removeprefix('torch.')} "
                         f"×{count}: {', '.join(spans)}")
    return lines
