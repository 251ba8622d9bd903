"""A decode step's decoder layers in one C++ call on the CPU (``engine.cpu_decode_loop``).

A small model's decode step is mostly overhead on the CPU: each Llama layer runs about sixty
small operators from Python (the norms, four linear calls with their conversions, rotary, the KV
write, attention, views), and at SmolLM2-135M's width the dispatch of those costs more than the
matmuls (docs/benchmarks.md, "Decode step overhead"). ``CpuDecodeLoop`` hands the whole stack of
layers to ``cpu_ops.decode_layers``, which runs the same kernels in the same order from C++, so
the step's values are those of the modules' own path bit for bit.

It takes a step whose every row is a one-query attention row written to a real slot (a decode, a
draft being checked), and only a stack it can run: Llama-shaped layers (``LlamaDecoderLayer``,
Qwen3's with their q/k norms among them) or Gemma 3's (``Gemma3DecoderLayer``: Gemma norms, q/k
norms, GELU-tanh, sliding layers on their own rotary base), with the fused CPU passes on
(``tandem.models.cpu_fusion``), full-width rotary on every layer, no biases, no residual
multiplier, one tensor rank, the "cpu" attention backend, and linear layers on tandem's panels
(float32, or bfloat16 pairs on AVX512-BF16 or AMX), oneDNN, dense weights or GGUF blocks (a layer's shards of
different block types as one part each; each batch-size bucket's kernel, as ``cpu_linear``
chose it). Everything else keeps the Python path; ``build`` returns None for a stack it cannot
run.
"""
from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Mapping

import torch
from torch import nn

from tandem.interfaces import AttentionMetadata
from tandem.kernels import cpu_ops
from tandem.kernels.gguf_types import BLOCKS as GGUF_KERNEL_BLOCKS
from tandem.models.cpu_linear import BucketedLinear, PackedLinear
from tandem.models.cpu_tuning import M_BUCKETS, bucket_index
from tandem.models.layers import GemmaRMSNorm, RMSNorm
from tandem.plugins.attention_cpu import CpuAttentionBackend
from tandem.plugins.attention_torch import DECODE_QUERY_MAX, PLAN_KEY

logger = logging.getLogger("tandem")

PREFETCH_KV_BYTES = 1 << 20
"""The KV bytes a layer asks for ahead when it does (a core's L2 on the machines measured)."""


class KvPrefetchChoice:
    """Whether a decode step's layers ask for their KV blocks before their qkv products
    (``decode_layers``' ``prefetch_kv_bytes``), decided by measuring on the running machine.

    The reads overlap the product on some CPUs and hold the calling thread up on others
    (docs/benchmarks.md), so no fixed rule is right. The first decode steps of at least
    ``MIN_ROWS`` rows take turns, with then without; each pair of consecutive steps of the same
    rows gives a time ratio (without / with), and after ``PAIRS`` pairs prefetching stays on for
    the process only where their median says it saved at least ``GAIN`` (logged): the extra
    reads cost instructions and cache, and a median within a percent or two of 1 is the
    machine's noise, which turned it on at one start of three where it costs a little
    (docs/benchmarks.md). If ``WINDOW`` such steps pass without enough pairs (batch sizes
    changing every step), prefetching stays on. Steps of fewer rows (little KV to read)
    prefetch while it is undecided. ``TANDEM_CPU_PREFETCH_KV_KB`` fixes it (KiB; 0: never)
    without measuring."""

    MIN_ROWS = 8
    PAIRS = 8
    WINDOW = 64
    GAIN = 1.02

    def __init__(self, env: Mapping[str, str] = os.environ) -> None:
        kb = env.get("TANDEM_CPU_PREFETCH_KV_KB")
        self.chosen: int | None = None if kb is None else max(0, int(kb)) << 10
        """The bytes every step asks for from now on; None while measuring."""
        self._on: tuple[int, float] | None = None  # (rows, seconds) of a step with, awaiting its pair
        self._ratios: list[float] = []
        self._steps = 0

    def bytes_for(self, rows: int) -> int:
        """The ``prefetch_kv_bytes`` of a step of ``rows`` rows."""
        if self.chosen is not None:
            return self.chosen
        return 0 if rows >= self.MIN_ROWS and self._on is not None else PREFETCH_KV_BYTES

    def record(self, rows: int, prefetch_bytes: int, seconds: float) -> None:
        """A step of ``rows`` rows took ``seconds`` with ``prefetch_bytes``."""
        if self.chosen is not None or rows < self.MIN_ROWS:
            return
        self._steps += 1
        if prefetch_bytes:
            self._on = (rows, seconds)
        elif self._on is not None:
            on_rows, on_seconds = self._on
            self._on = None
            if on_rows == rows and on_seconds > 0:
                self._ratios.append(seconds / on_seconds)
        if len(self._ratios) >= self.PAIRS:
            ratio = statistics.median(self._ratios)
            self.chosen = PREFETCH_KV_BYTES if ratio >= self.GAIN else 0
            logger.info("decode steps: without asking for the KV ahead a step took %.2fx as long (median of %d "
                        "pairs of steps): %s", ratio, len(self._ratios),
                        "not asking" if self.chosen == 0 else "asking for up to 1 MiB a layer")
        elif self._steps >= self.WINDOW:
            self.chosen = PREFETCH_KV_BYTES


KINDS = {"tandem": 0, "onednn": 1, "torch": 2, "gguf": 3, "dpbf16": 4, "amx": 5}
"""Linear kinds as ``decode_layers.cpp`` numbers them."""
FLAGS = {"qk_norm": 1, "gemma": 2, "gelu": 4}
"""The layer shape's flags as ``decode_layers.cpp`` numbers them."""


class CpuDecodeLoop:
    """The layers of one pipeline stage as a single ``decode_layers`` call; see the module doc."""

    def __init__(self, layers: list[nn.Module], flags: int, local_rope: list[bool],
                 final_norm: torch.Tensor | None = None) -> None:
        attn = layers[0].self_attn
        self.layers = layers
        self.flags = flags
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.scale = attn.attn.scale
        self.eps = layers[0].input_layernorm.eps
        self.norms = [n.weight for layer in layers for n in _norms(layer, flags)]
        self.final_norm = final_norm
        """The model's norm after the last layer, applied by the call (None: the caller's)."""
        self.windows = [layer.self_attn.attn.sliding_window or 0 for layer in layers]
        self.local = [int(x) for x in local_rope]
        self._linears = [lin for layer in layers for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                             layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        self._by_bucket: dict[int, tuple[list[torch.Tensor], list[int], list[int]] | None] = {}
        self.kv_prefetch = KvPrefetchChoice()

    @classmethod
    def build(cls, layers: list[nn.Module], local_rope: list[bool] | None = None,
              final_norm: nn.Module | None = None) -> CpuDecodeLoop | None:
        """The loop over ``layers`` (a stage's decoder layers, in order; ``local_rope[i]`` True
        where layer ``i`` takes the model's local rotary tables, Gemma's sliding layers), or None
        where one of them is not a stack the C++ loop runs (module doc). ``final_norm``: the
        model's norm after them (the last stage's), which the call then applies itself where it
        is the fused norm of the layers' kind and epsilon (``final_norm`` is None otherwise)."""
        if not layers or not cpu_ops.load():
            return None
        first = layers[0]
        flags = _layer_flags(first, 0)
        if flags is None:
            return None
        ref, eps = first.self_attn, first.input_layernorm.eps
        for i, layer in enumerate(layers):
            attn = layer.self_attn
            same = (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.attn.scale) \
                == (ref.num_heads, ref.num_kv_heads, ref.head_dim, ref.attn.scale)
            if _layer_flags(layer, i) != flags or not same or any(n.eps != eps for n in _norms(layer, flags)):
                return None
        norm_type = GemmaRMSNorm if flags & FLAGS["gemma"] else RMSNorm
        fold = (final_norm is not None and type(final_norm) is norm_type and final_norm.kernel is not None
                and final_norm.eps == eps)
        loop = cls(layers, flags, local_rope or [False] * len(layers), final_norm.weight if fold else None)
        if all(loop._specs(bucket) is None for bucket in range(len(M_BUCKETS))):
            return None
        return loop

    def can_run(self, hidden: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata) -> bool:
        """True when this step is one the loop takes: a decode step (no sequence with more than
        ``DECODE_QUERY_MAX`` query rows: the cpu backend makes a prefill's tokens one-query rows
        too, but prefills keep the modules' path), every row a one-query attention row with a
        slot, on the CPU, the pool of the hidden state's dtype, and this batch size's linear
        kernels ones the loop calls."""
        plan = metadata.extra.get(PLAN_KEY)
        return (plan is not None and plan.decode is not None and not plan.prefills and plan.write_rows is None
                and metadata.max_query_len <= DECODE_QUERY_MAX
                and not plan.padded and hidden.device.type == "cpu" and kv_cache.dtype == hidden.dtype
                and hidden.is_contiguous()
                and self._specs(bucket_index(hidden.shape[0])) is not None)

    def __call__(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                 kv_cache: torch.Tensor, metadata: AttentionMetadata,
                 local: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers' (output, residual) for a step ``can_run`` accepted (Gemma's: the residual
        stream twice), the output through the final norm when ``final_norm`` is set (the
        model's norm's (normed, residual)); ``local`` the (cos, sin) of the local-rope layers."""
        plan = metadata.extra[PLAN_KEY]
        d = plan.decode
        weights, info, parts = self._specs(bucket_index(hidden.shape[0]))
        cos_local, sin_local = (None, None) if local is None else (local[0].contiguous(), local[1].contiguous())
        rows = hidden.shape[0]
        prefetch = self.kv_prefetch.bytes_for(rows)
        start = time.perf_counter()
        out = cpu_ops.decode_layers(
            hidden, residual, self.norms, weights, info, parts, cos.contiguous(), sin.contiguous(), cos_local, sin_local,
            self.local, kv_cache, metadata.slot_mapping, d.rows, d.tables,
            d.seq_lens, self.windows, self.heads, self.kv_heads, self.head_dim, self.scale, self.eps, self.flags,
            self.final_norm, prefetch, d.row_tables)
        self.kv_prefetch.record(rows, prefetch, time.perf_counter() - start)
        return out

    def _specs(self, bucket: int) -> tuple[list[torch.Tensor], list[int], list[int]] | None:
        """The linears' (weights, info, parts) at batch-size bucket ``bucket``, as
        ``decode_layers`` takes them; None when one of them is on a kernel the loop does not
        call."""
        if bucket not in self._by_bucket:
            specs = [_linear_spec(lin, bucket) for lin in self._linears]
            self._by_bucket[bucket] = None if None in specs else (
                [w for spec in specs for w, _ in spec], [v for spec in specs for _, info in spec for v in info],
                [len(spec) for spec in specs])
        return self._by_bucket[bucket]


def _layer_flags(layer: nn.Module, index: int) -> int | None:
    """The ``FLAGS`` of a layer the loop runs, None for one it cannot (module doc)."""
    from tandem.models.gemma3 import Gemma3DecoderLayer
    from tandem.models.llama import LlamaDecoderLayer

    gemma = type(layer) is Gemma3DecoderLayer
    if type(layer) is not LlamaDecoderLayer and not gemma:
        return None
    attn, mlp = layer.self_attn, layer.mlp
    norm_type = GemmaRMSNorm if gemma else RMSNorm
    flags = (FLAGS["gemma"] if gemma else 0) | (FLAGS["qk_norm"] if attn.q_norm is not None else 0) \
        | (FLAGS["gelu"] if mlp.fused_act == "gelu_tanh" else 0)
    hidden_norms = _norms(layer, flags & ~FLAGS["qk_norm"])
    ok = (layer.residual_multiplier == 1.0 and all(type(n) is norm_type and n.kernel is not None for n in hidden_norms)
          and (attn.q_norm is None or type(attn.q_norm) is type(attn.k_norm) is norm_type)
          and attn.fused and attn.use_rope and attn.kv_index == index
          and isinstance(attn.attn, CpuAttentionBackend) and mlp.fused
          and all(lin.bias is None and not lin.splits
                  for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)))
    return flags if ok else None


def _norms(layer: nn.Module, flags: int) -> list[nn.Module]:
    """The layer's norms in ``decode_layers``' order: input, post-attention, (pre- and
    post-feedforward), (q, k)."""
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if flags & FLAGS["gemma"]:
        norms += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
    if flags & FLAGS["qk_norm"]:
        norms += [layer.self_attn.q_norm, layer.self_attn.k_norm]
    return norms


def _linear_spec(layer: nn.Module, bucket: int) -> list[tuple[torch.Tensor, list[int]]] | None:
    """The layer's parts as ``decode_layers`` takes them: (weight, [kind, out, in, ggml_type])
    each; None where one is on a kernel the loop does not call."""
    method = layer.quant_method
    n, k = sum(layer.output_sizes), layer.input_size
    if method.name == "gguf":
        if layer.params_dtype not in (torch.float32, torch.bfloat16):
            return None
        spec = []
        for part in layer.gguf_parts:
            if part.ggml_type is None:
                spec.append((getattr(layer, part.param), [KINDS["torch"], part.size, k, 0]))
            elif part.ggml_type in GGUF_KERNEL_BLOCKS:
                spec.append((getattr(layer, part.param), [KINDS["gguf"], part.size, k, part.ggml_type]))
            else:
                return None
        return spec
    if method.name != "unquantized":
        return None
    packed = layer.packed
    if isinstance(packed, BucketedLinear):
        packed = packed.by_bucket[bucket]
    if packed is None:
        return [(layer.weight, [KINDS["torch"], n, k, 0])]
    assert isinstance(packed, PackedLinear)
    return [(packed.weight, [KINDS[packed.kind], n, k, 0])]


def enable_cpu_decode_loop(model: nn.Module) -> bool:
    """Give ``model``'s decoder stack (``model.model``, a ``PipelineStage`` with a
    ``decode_loop`` attribute, and ``local_rope_layers`` where some layers take the local rotary
    tables) the C++ decode loop where it can run it; True when it took it."""
    stack = getattr(model, "model", None)
    if stack is None or not hasattr(stack, "decode_loop"):
        return False
    stack.decode_loop = CpuDecodeLoop.build(list(stack.stage_layers()), getattr(stack, "local_rope_layers", None),
                                            getattr(stack, "norm", None))
    return stack.decode_loop is not None
