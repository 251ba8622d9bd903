"""A decode step's decoder layers in one C++ call on the CPU (``engine.cpu_decode_loop``).

A small model's decode step is mostly overhead on the CPU: each Llama layer runs about sixty
small operators from Python (the norms, four linear calls with their conversions, rotary, the KV
write, attention, views), and at SmolLM2-135M's width the dispatch of those costs more than the
matmuls (docs/benchmarks.md, "Decode step overhead"). ``CpuDecodeLoop`` hands the whole stack of
layers to ``cpu_ops.decode_layers``, which runs the same kernels in the same order from C++, so
the step's values are those of the modules' own path bit for bit.

It takes a step whose every row is a one-query attention row written to a real slot (a decode, a
draft being checked), and only a stack it can run: Llama-shaped layers (``LlamaDecoderLayer``)
with the fused CPU passes on (``tandem.models.cpu_fusion``), plain RMSNorms, full-width rotary
on every layer, no q/k norms, no biases, SiLU, no residual multiplier, one tensor rank, the
"cpu" attention backend, and linear layers on tandem's panels (float32 or AVX512-BF16 pairs), oneDNN, dense weights or GGUF
blocks of one type per layer (each batch-size bucket's kernel, as ``cpu_linear`` chose it).
Everything else keeps the Python path; ``build`` returns None for a stack it cannot run.
"""
from __future__ import annotations

import torch
from torch import nn

from tandem.interfaces import AttentionMetadata
from tandem.kernels import cpu_ops
from tandem.kernels.gguf_types import BLOCKS as GGUF_KERNEL_BLOCKS
from tandem.models.cpu_linear import BucketedLinear, PackedLinear
from tandem.models.cpu_tuning import M_BUCKETS, bucket_index
from tandem.models.layers import RMSNorm
from tandem.plugins.attention_cpu import CpuAttentionBackend
from tandem.plugins.attention_torch import PLAN_KEY

KINDS = {"tandem": 0, "onednn": 1, "torch": 2, "gguf": 3, "dpbf16": 4}
"""Linear kinds as ``decode_layers.cpp`` numbers them."""


class CpuDecodeLoop:
    """The layers of one pipeline stage as a single ``decode_layers`` call; see the module doc."""

    def __init__(self, layers: list[nn.Module]) -> None:
        attn = layers[0].self_attn
        self.layers = layers
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.scale = attn.attn.scale
        self.eps = layers[0].input_layernorm.eps
        self.norms = [w for layer in layers for w in (layer.input_layernorm.weight,
                                                      layer.post_attention_layernorm.weight)]
        self.windows = [layer.self_attn.attn.sliding_window or 0 for layer in layers]
        self._linears = [lin for layer in layers for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                             layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        self._by_bucket: dict[int, tuple[list[torch.Tensor], list[int]] | None] = {}

    @classmethod
    def build(cls, layers: list[nn.Module]) -> CpuDecodeLoop | None:
        """The loop over ``layers`` (a stage's decoder layers, in order), or None where one of
        them is not a stack the C++ loop runs (module doc)."""
        from tandem.models.llama import LlamaDecoderLayer

        if not layers or not cpu_ops.load():
            return None
        first = layers[0]
        for i, layer in enumerate(layers):
            if type(layer) is not LlamaDecoderLayer or not _plain_layer(layer, i):
                return None
            attn, ref = layer.self_attn, first.self_attn
            same = (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.attn.scale, layer.input_layernorm.eps) \
                == (ref.num_heads, ref.num_kv_heads, ref.head_dim, ref.attn.scale, first.input_layernorm.eps)
            if not same:
                return None
        loop = cls(layers)
        if all(loop._specs(bucket) is None for bucket in range(len(M_BUCKETS))):
            return None
        return loop

    def can_run(self, hidden: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata) -> bool:
        """True when this step is one the loop takes: every row a one-query attention row with a
        slot, on the CPU, the pool of the hidden state's dtype, and this batch size's linear
        kernels ones the loop calls."""
        plan = metadata.extra.get(PLAN_KEY)
        return (plan is not None and plan.decode is not None and not plan.prefills and plan.write_rows is None
                and not plan.padded and hidden.device.type == "cpu" and kv_cache.dtype == hidden.dtype
                and hidden.is_contiguous()
                and self._specs(bucket_index(hidden.shape[0])) is not None)

    def __call__(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                 kv_cache: torch.Tensor, metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers' (output, residual) for a step ``can_run`` accepted."""
        plan = metadata.extra[PLAN_KEY]
        d = plan.decode
        weights, info = self._specs(bucket_index(hidden.shape[0]))
        return cpu_ops.decode_layers(
            hidden, residual, self.norms, weights, info, cos.contiguous(), sin.contiguous(), kv_cache,
            metadata.slot_mapping, d.rows, d.block_ids.view(d.rows.shape[0], d.num_blocks), d.seq_lens,
            self.windows, self.heads, self.kv_heads, self.head_dim, self.scale, self.eps)

    def _specs(self, bucket: int) -> tuple[list[torch.Tensor], list[int]] | None:
        """Each linear's (weight, info) at batch-size bucket ``bucket``; None when one of them
        is on a kernel the loop does not call."""
        if bucket not in self._by_bucket:
            specs = [_linear_spec(lin, bucket) for lin in self._linears]
            self._by_bucket[bucket] = None if None in specs else (
                [w for w, _ in specs], [v for _, info in specs for v in info])
        return self._by_bucket[bucket]


def _plain_layer(layer: nn.Module, index: int) -> bool:
    attn, mlp = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    return (layer.residual_multiplier == 1.0 and all(type(n) is RMSNorm and n.kernel is not None for n in norms)
            and attn.fused and attn.use_rope and attn.q_norm is None and attn.kv_index == index
            and isinstance(attn.attn, CpuAttentionBackend) and mlp.fused
            and all(lin.bias is None and not lin.splits
                    for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)))


def _linear_spec(layer: nn.Module, bucket: int) -> tuple[torch.Tensor, list[int]] | None:
    method = layer.quant_method
    n, k = sum(layer.output_sizes), layer.input_size
    if method.name == "gguf":
        parts = layer.gguf_parts
        if len(parts) != 1 or parts[0].ggml_type not in GGUF_KERNEL_BLOCKS \
                or layer.params_dtype not in (torch.float32, torch.bfloat16):
            return None
        return getattr(layer, parts[0].param), [KINDS["gguf"], n, k, parts[0].ggml_type]
    if method.name != "unquantized":
        return None
    packed = layer.packed
    if isinstance(packed, BucketedLinear):
        packed = packed.by_bucket[bucket]
    if packed is None:
        return layer.weight, [KINDS["torch"], n, k, 0]
    assert isinstance(packed, PackedLinear)
    return packed.weight, [KINDS[packed.kind], n, k, 0]


def enable_cpu_decode_loop(model: nn.Module) -> bool:
    """Give ``model``'s decoder stack (``model.model``, a Llama-shaped ``PipelineStage``) the
    C++ decode loop where it can run it; True when it took it."""
    stack = getattr(model, "model", None)
    if stack is None or not hasattr(stack, "decode_loop"):
        return False
    stack.decode_loop = CpuDecodeLoop.build(list(stack.stage_layers()))
    return stack.decode_loop is not None
