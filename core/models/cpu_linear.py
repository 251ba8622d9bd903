"""Linear layers on the CPU with their weights packed once (``engine.cpu_kernels``).

Why: ``F.linear`` on a plain row-major weight uses the FMA units poorly at decode batch sizes,
and a CPU without bfloat16 instructions emulates bfloat16 GEMMs. ``pack_cpu_linears(model, mode)``
runs once after the weights are loaded and gives every unquantized ``LinearLayer`` and the LM
head a ``PackedLinear`` (``layer.packed``), which ``UnquantizedLinearMethod.apply`` and
``LMHead.forward`` call instead; the dense weight is freed (the embedding keeps its table when
the head is tied to it).

Kernels (``mode``):

- ``tandem``: tandem's own panels (``kernels/cpu/linear.cpp``, docs/architecture.md §11): 16-bit
  weights stay 16-bit and widen to float32 as they load, so they read half the bytes;
- ``onednn``: oneDNN's reordered weights (``torch.ops.mkldnn``), in the model's dtype where the
  CPU has instructions for it, else in float32 (twice the memory of a 16-bit model);
- ``torch``: ``F.linear`` on the plain weights — the reference the tests compare against;
- ``auto``: ``tandem`` when its kernels build here, else ``onednn`` when torch has oneDNN, else
  ``torch``.

Every kernel returns the input's dtype; the sums are float32 in all of them.
"""
from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from tandem.kernels import cpu_ops

logger = logging.getLogger("tandem")

MODES = ("auto", "tandem", "onednn", "torch")
PANEL = 16


class PackedLinear:
    """One linear layer's packed weight and the call that multiplies by it:
    ``packed(x [M, K], bias [N] | None) -> [M, N]`` in ``x``'s dtype."""

    __slots__ = ("kind", "weight", "out_features", "in_features")

    def __init__(self, kind: str, weight: torch.Tensor, out_features: int, in_features: int) -> None:
        self.kind, self.weight = kind, weight
        self.out_features, self.in_features = out_features, in_features

    @classmethod
    def pack(cls, kind: str, weight: torch.Tensor) -> PackedLinear:
        """Pack ``weight`` [out, in] for ``kind`` ("tandem" or "onednn")."""
        weight = weight.detach()
        n, k = weight.shape
        if kind == "tandem":
            if not cpu_ops.load():
                raise ValueError("tandem's CPU kernels could not be built (see the warning above)")
            panels = -(-n // PANEL)
            padded = torch.zeros(panels * PANEL, k, dtype=weight.dtype)
            padded[:n] = weight
            packed = padded.view(panels, PANEL, k).transpose(1, 2).contiguous()
        else:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(onednn_dtype(weight.dtype)).contiguous(), 1)
        return cls(kind, packed, n, k)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.kind == "tandem":
            if x2.dtype != torch.float32 or x2.stride(-1) != 1:
                x2 = x2.to(torch.float32).contiguous()
            out = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32)
            if bias is not None and bias.dtype != torch.float32:
                bias = bias.float()
            cpu_ops.panel_linear(out, x2, self.weight, bias)
        else:
            compute = self.weight.dtype
            out = torch.ops.mkldnn._linear_pointwise(
                x2 if x2.dtype == compute else x2.to(compute), self.weight,
                None if bias is None else bias.to(compute), "none", [], "")
        if out.dtype != x.dtype:
            out = out.to(x.dtype)
        return out.view(*lead, self.out_features)


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


def resolve_kind(mode: str, device: torch.device) -> str:
    """The kernel ``mode`` stands for on ``device``: "tandem", "onednn" or "torch"."""
    if mode not in MODES:
        raise ValueError(f"engine.cpu_kernels = {mode!r}; allowed: {', '.join(MODES)}")
    if device.type != "cpu" or mode == "torch":
        return "torch"
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


def pack_cpu_linears(model: nn.Module, mode: str, device: torch.device) -> str:
    """Give every unquantized linear layer of ``model`` and its LM head a ``PackedLinear`` of the
    kernel ``mode`` resolves to (see the module doc), freeing the dense weights they replace.
    Returns that kernel's name ("torch": nothing packed)."""
    from tandem.models.layers import LinearLayer, LMHead

    kind = resolve_kind(mode, device)
    if kind == "torch":
        return kind
    count, dtypes = 0, set()
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "packed", None) is not None:
                continue
            if isinstance(module, LinearLayer) and module.quant_method.name == "unquantized":
                dtypes.add(module.weight.dtype)
                module.packed = PackedLinear.pack(kind, module.weight)
                module.weight = None
            elif isinstance(module, LMHead):
                dtypes.add(module.weight.dtype)
                module.packed = PackedLinear.pack(kind, module.weight)
                if not module.tied:
                    module.weight = None
            else:
                continue
            count += 1
    if count:
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
        upcast = kind == "onednn" and any(onednn_dtype(d) != d for d in dtypes)
        logger.info("linear layers: %d packed for the %s CPU kernel (%s weights%s)", count, kind, names,
                    ", multiplied in float32: this CPU has no instructions for them" if upcast else "")
    return kind
