"""The building blocks of the Llama-family models: norm, linear, embedding, LM head, MLP, attention.

Parameters are created empty (``torch.empty``) in the current default dtype and device — the
loader sets both — and filled by ``load_weights``; nothing here initialises weights randomly.
Linear layers get their parameters from a ``tandem.interfaces.QuantMethod`` so that quantized
formats plug in without touching the models; the embedding and the LM head stay unquantized,
unless the method quantizes them too (``quantizes_embeddings``: ``make_embedding``,
``make_lm_head`` build them as linear layers of the method then).

Under tensor parallelism (``tandem.distributed``, read when a layer is built) each rank
builds its share and cuts each checkpoint tensor as it loads (Megatron's layout):

    qkv_proj, gate_up_proj   column-parallel: each fused shard's outputs cut tp ways (K and V
                             heads replicated when there are fewer of them than ranks)
    o_proj, down_proj        row-parallel: inputs cut tp ways, outputs all-reduced, bias added
                             once after the sum
    embed_tokens, lm_head    vocabulary-parallel: rows cut tp ways (the vocabulary padded to a
                             multiple of tp); lookups all-reduced, logits gathered on tp rank 0
    norms, q/k norms         replicated
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tandem.distributed import ParallelContext, check_tensor_parallel, current
from tandem.interfaces import AttentionBackend, AttentionMetadata, QuantMethod, TensorSplit
from tandem.kernels import cpu_ops
from tandem.models.cpu_linear import silu_pass
from tandem.models.rotary import rotate

if TYPE_CHECKING:
    from tandem.models.config import ModelArchConfig


FusedNorm = Callable[[torch.Tensor, "torch.Tensor | None", torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
"""A fused residual add + RMSNorm: ``(x, residual, weight, eps) -> (normed, new residual)``."""


def _empty_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x²) + eps)``, computed in float32 and cast back as HF does.

    With ``residual`` given, the residual add is fused in front: the input becomes
    ``x + residual``, and that sum is returned as the new residual::

        out, residual = norm(x)             # first layer: residual = x
        out, residual = norm(x, residual)   # later: residual = x + residual
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = _empty_param(hidden_size)
        self.eps = eps
        self._kernel: FusedNorm | None = None

    @property
    def kernel(self) -> FusedNorm | None:
        """The fused pass ``forward`` runs instead of torch's (``use_kernel``), None: torch."""
        return self._kernel

    def use_kernel(self, kernel: FusedNorm) -> bool:
        """Run ``kernel(x, residual, weight, eps)``, a fused pass with ``forward``'s contract,
        from now on (on contiguous inputs of the weight's dtype); True when this norm takes it.
        The passes: ``tandem.models.cpu_fusion`` on the CPU (one C++ pass, which overwrites
        ``x`` when a residual is given: the layer's own fresh output) and
        ``tandem.models.cuda_fusion`` on CUDA (tandem's Triton kernel, which overwrites
        ``residual`` with the sum)."""
        self._kernel = kernel
        return True

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._kernel is not None and x.dtype == self.weight.dtype and x.is_contiguous() \
                and (residual is None or residual.is_contiguous()):
            return self._kernel(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
        normed = F.rms_norm(x.to(torch.float32), x.shape[-1:], eps=self.eps)
        return self._scale(normed, x.dtype), x

    def _scale(self, normed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.weight * normed.to(dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the checkpoint stores the weight minus one, and the scaling happens in
    float32 before the cast: ``(normed * (1 + weight)).to(dtype)``. Same ``residual`` contract."""

    def _scale(self, normed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (normed * (1.0 + self.weight.float())).to(dtype)


class LinearLayer(nn.Module):
    """``y = x @ W.T + b`` with ``sum(output_sizes)`` outputs made of fused shards.

    Shard ``i`` (e.g. q, k, v of a fused QKV projection) occupies outputs
    ``sum(output_sizes[:i]) .. sum(output_sizes[:i+1])-1`` and is loaded from its own checkpoint
    tensors with ``load(name, tensor, shard=i)``. The weight's layout belongs to ``quant_method``;
    the bias (when present) is a plain vector in the default dtype, loaded here.

    Sizes are the whole layer's. Tensor parallelism: ``splits`` (one ``TensorSplit`` per shard,
    dim "output") makes it column-parallel — this rank keeps part ``index`` of ``parts`` of each
    shard's outputs; ``splits`` of one split with dim "input" makes it row-parallel — this rank
    keeps its part of the inputs and all-reduces its partial outputs over ``parallel``.
    Checkpoint tensors are whole; ``load`` cuts them.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, quant_method: QuantMethod,
                 splits: list[TensorSplit] | None = None, parallel: ParallelContext | None = None):
        super().__init__()
        self.splits = splits or []
        self.row_parallel = bool(self.splits) and self.splits[0].dim == "input"
        self.parallel = parallel
        self.full_output_sizes = list(output_sizes)
        self.full_input_size = input_size
        if self.row_parallel:
            input_size //= self.splits[0].parts
        elif self.splits:
            output_sizes = [size // split.parts for size, split in zip(output_sizes, self.splits)]
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.quant_method = quant_method
        self.packed = None
        """On the CPU, the unquantized weight packed for a CPU kernel (``tandem.models.cpu_linear``)."""
        quant_method.create_weights(self, input_size, self.output_sizes, torch.get_default_dtype())
        self.bias = _empty_param(sum(output_sizes)) if bias else None

    def load(self, name: str, tensor: torch.Tensor, shard: int = 0) -> None:
        """Load checkpoint tensor ``name`` ("weight", "bias", "qweight"…) of output ``shard``
        (whole, as the checkpoint stores it: a tensor-parallel layer keeps its part)."""
        if self.splits and not (self.row_parallel and name == "bias"):
            split = self.splits[0] if self.row_parallel else self.splits[shard]
            logical = self.full_input_size if self.row_parallel else self.full_output_sizes[shard]
            if name == "bias":
                tensor = tensor.narrow(0, split.index * (logical // split.parts), logical // split.parts)
            else:
                tensor = self.quant_method.split_tensor(name, tensor, split, logical)
        if name != "bias":
            self.quant_method.load_weight(self, name, tensor, shard)
            return
        if self.bias is None:
            raise ValueError("the checkpoint has a bias for a linear layer configured without one")
        start = sum(self.output_sizes[:shard])
        target = self.bias.data[start : start + self.output_sizes[shard]]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"bias shard {shard} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
        target.copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.row_parallel:
            return self.quant_method.apply(self, x, self.bias)
        out = self.parallel.all_reduce(self.quant_method.apply(self, x, None))
        return out if self.bias is None else out + self.bias


def column_splits(parallel: ParallelContext, num_shards: int) -> list[TensorSplit] | None:
    """Every shard cut ``tp`` ways (None at tp = 1)."""
    if parallel.tp_size == 1:
        return None
    return [TensorSplit("output", parallel.tp_size, parallel.tp_rank)] * num_shards


def row_split(parallel: ParallelContext) -> list[TensorSplit] | None:
    return None if parallel.tp_size == 1 else [TensorSplit("input", parallel.tp_size, parallel.tp_rank)]


class Embedding(nn.Module):
    """Token embedding table ``[vocab_size, hidden_size]`` (unquantized). Vocabulary-parallel at
    tp > 1: this rank holds rows ``vocab_start .. vocab_start + rows - 1`` of the table padded
    to a multiple of tp; ids outside them embed to zeros, and the all-reduce sums the ranks."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.parallel = current()
        tp = self.parallel.tp_size
        self.vocab_size = vocab_size
        self.rows = -(-vocab_size // tp)
        self.vocab_start = self.parallel.tp_rank * self.rows
        self.weight = _empty_param(self.rows, hidden_size)

    def load(self, tensor: torch.Tensor) -> None:
        """Copy this rank's rows of the whole checkpoint table (the padding rows stay zero)."""
        if tuple(tensor.shape) != (self.vocab_size, self.weight.shape[1]):
            raise ValueError(f"has shape {tuple(tensor.shape)}, expected {(self.vocab_size, self.weight.shape[1])}")
        part = tensor[self.vocab_start : self.vocab_start + self.rows]
        self.weight.data.zero_()
        self.weight.data[: part.shape[0]].copy_(part)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.parallel.all_reduce(h.masked_fill(outside.unsqueeze(-1), 0))


class LMHead(nn.Module):
    """Hidden states → float32 logits. Unquantized; shares the embedding's weight when tied.
    Vocabulary-parallel at tp > 1 (the same rows as ``Embedding``): the logits of every rank are
    gathered on tensor rank 0, and the other ranks get None."""

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: Embedding | None = None) -> None:
        super().__init__()
        self.parallel = current()
        self.tied = tied_to is not None
        self.vocab_size = vocab_size
        self.rows = -(-vocab_size // self.parallel.tp_size)
        self.vocab_start = self.parallel.tp_rank * self.rows
        self.weight = tied_to.weight if tied_to is not None else _empty_param(self.rows, hidden_size)
        self.packed = None
        """On the CPU, the weight packed for a CPU kernel (``tandem.models.cpu_linear``); the
        matmul uses it instead of ``weight``."""

    load = Embedding.load

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        if self.packed is not None:
            logits = self.packed.logits(hidden)
        else:
            logits = F.linear(hidden, self.weight).float()
        if self.parallel.tp_size == 1:
            return logits
        logits = self.parallel.gather_last_dim(logits)
        return None if logits is None else logits[..., : self.vocab_size]


class QuantizedVocab(LinearLayer):
    """The vocabulary table ``[vocab_size, hidden_size]`` kept by a quant method that quantizes
    it (``QuantMethod.quantizes_embeddings``): a linear layer of ``hidden_size`` inputs and
    ``vocab_size`` outputs, loaded like any other. ``embed`` is the token embedding (the method's
    row lookup), ``logits`` the LM head (its matmul, float32 logits). Vocabulary-parallel at
    tp > 1 as ``Embedding``, without padding: the vocabulary must divide by tp (a ValueError
    naming the tensor at load otherwise)."""

    def __init__(self, vocab_size: int, hidden_size: int, quant_method: QuantMethod) -> None:
        parallel = current()
        super().__init__(hidden_size, [vocab_size], False, quant_method, column_splits(parallel, 1), parallel)
        self.vocab_size = vocab_size
        self.rows = self.output_sizes[0]
        self.vocab_start = parallel.tp_rank * self.rows

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return self.quant_method.embed(self, input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows)
        h = self.quant_method.embed(self, local.masked_fill(outside, 0))
        return self.parallel.all_reduce(h.masked_fill(outside.unsqueeze(-1), 0))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.quant_method.apply(self, hidden).float()
        return logits if self.parallel.tp_size == 1 else self.parallel.gather_last_dim(logits)


class QuantizedEmbedding(QuantizedVocab):
    forward = QuantizedVocab.embed


class QuantizedLMHead(QuantizedVocab):
    tied = False
    forward = QuantizedVocab.logits


class TiedQuantizedLMHead(nn.Module):
    """The LM head tied to a ``QuantizedEmbedding``: that table's ``logits``."""

    tied = True

    def __init__(self, embedding: QuantizedEmbedding) -> None:
        super().__init__()
        self.embedding = embedding

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.embedding.logits(hidden)


def make_embedding(vocab_size: int, hidden_size: int, quant_method: QuantMethod) -> nn.Module:
    """The token embedding: a ``QuantizedEmbedding`` where ``quant_method`` quantizes
    embeddings, else a plain ``Embedding``."""
    if quant_method.quantizes_embeddings:
        return QuantizedEmbedding(vocab_size, hidden_size, quant_method)
    return Embedding(vocab_size, hidden_size)


def make_lm_head(vocab_size: int, hidden_size: int, quant_method: QuantMethod,
                 tied_to: nn.Module | None) -> nn.Module:
    """The LM head (tied to the embedding ``tied_to`` when given), quantized as ``make_embedding``."""
    if not quant_method.quantizes_embeddings:
        return LMHead(vocab_size, hidden_size, tied_to)
    if tied_to is not None:
        return TiedQuantizedLMHead(tied_to)
    return QuantizedLMHead(vocab_size, hidden_size, quant_method)


ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "gelu_new": functools.partial(F.gelu, approximate="tanh"),
}


_FUSED_ACTS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
"""HF activation names with a fused CPU pass, and the pass."""


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate and up fused into one projection (shards 0, 1);
    ``act`` is one of ``ACTIVATIONS`` (HF's names)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, hidden_act: str,
                 quant_method: QuantMethod) -> None:
        super().__init__()
        if hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {hidden_act!r}; supported: {', '.join(ACTIVATIONS)}")
        self.act = ACTIVATIONS[hidden_act]
        self.act_name = hidden_act
        parallel = current()
        if intermediate_size % parallel.tp_size:
            raise ValueError(f"tensor_parallel_size = {parallel.tp_size} does not divide the MLP's "
                             f"intermediate_size {intermediate_size}")
        self.intermediate_size = intermediate_size // parallel.tp_size
        self.gate_up_proj = LinearLayer(hidden_size, [intermediate_size] * 2, bias, quant_method,
                                        column_splits(parallel, 2), parallel)
        self.down_proj = LinearLayer(intermediate_size, [hidden_size], bias, quant_method,
                                     row_split(parallel), parallel)
        self._fused = False
        self._fused_act: str | None = None

    @property
    def fused(self) -> bool:
        """True once ``use_cpu_kernels`` took the fused act."""
        return self._fused

    @property
    def fused_act(self) -> str | None:
        """The act the fused pass computes ("silu" or "gelu_tanh"), None: torch's."""
        return self._fused_act

    def use_cpu_kernels(self) -> bool:
        """Compute ``act(gate) * up`` in one C++ pass (``tandem.kernels.cpu_ops.silu_and_mul``,
        ``gelu_tanh_and_mul``) from now on, when the act is SiLU or tanh-approximated GELU; True
        when it does. CPU tensors only (the pass of ``tandem.models.cpu_fusion``)."""
        self._fused_act = _FUSED_ACTS.get(self.act_name)
        self._fused = self._fused_act is not None
        return self._fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused_act == "silu" and x.dtype == torch.bfloat16:
            rows = x.reshape(-1, x.shape[-1])
            one_pass = silu_pass(self.gate_up_proj, rows.shape[0])
            if one_pass is not None:  # the product and SiLU-and-mul in one pass (AMX or AVX512-BF16)
                kernel, panels = one_pass
                act = torch.empty(rows.shape[0], self.intermediate_size, dtype=x.dtype)
                kernel(act, rows.contiguous(), panels)
                return self.down_proj(act.view(*x.shape[:-1], self.intermediate_size))
        if self._fused:
            gate_up = self.gate_up_proj(x)
            act = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
            if self._fused_act == "silu":
                cpu_ops.silu_and_mul(act, gate_up)
            else:
                cpu_ops.gelu_tanh_and_mul(act, gate_up)
            return self.down_proj(act)
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)


@dataclass(frozen=True, slots=True)
class AttentionOptions:
    """What differs between the attention blocks of the Llama family: a bias on the q/k/v and
    on the output projections; ``qk_norm``, the norm class (RMSNorm for Qwen3, GemmaRMSNorm for
    Gemma 3) applied over the head dimension of every query and key head before the rotary
    embedding (``q_norm``/``k_norm``); ``scale`` of the attention scores (default
    ``head_dim ** -0.5``)."""

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: type[RMSNorm] | None = None
    scale: float | None = None


class Attention(nn.Module):
    """Self-attention of layer ``layer_idx``: fused QKV projection (shards q, k, v), optional
    per-head q/k norms, rotary embedding (unless the config exempts the layer), one attention
    backend instance over ``kv_cache[:, kv_index]`` (the layer's place in this rank's pool:
    ``layer_idx`` less the first layer of its pipeline stage), output projection. Query head
    ``h`` uses KV head ``h // (num_heads // num_kv_heads)`` (GQA as HF's repeat_kv). At tp > 1
    ``num_heads`` and ``num_kv_heads`` are this rank's: a contiguous range of query heads and
    the KV heads they use."""

    def __init__(self, config: ModelArchConfig, layer_idx: int, quant_method: QuantMethod,
                 attn_backend_cls: type[AttentionBackend], options: AttentionOptions) -> None:
        super().__init__()
        parallel = current()
        self.layer_idx = layer_idx
        self.kv_index = layer_idx - parallel.stage_layers(config.num_hidden_layers).start
        self.use_rope = config.uses_rope(layer_idx)
        self.rotary_dim = config.rotary_dim or config.head_dim
        self.head_dim = config.head_dim
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        check_tensor_parallel(heads, kv_heads, parallel.tp_size)
        kv_parts, kv_index = parallel.kv_head_split(kv_heads)
        self.num_heads = heads // parallel.tp_size
        self.num_kv_heads = kv_heads // kv_parts
        splits = None
        if parallel.tp_size > 1:
            q_split = TensorSplit("output", parallel.tp_size, parallel.tp_rank)
            kv_split = TensorSplit("output", kv_parts, kv_index)
            splits = [q_split, kv_split, kv_split]
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = LinearLayer(config.hidden_size, [heads * self.head_dim, kv_heads * self.head_dim,
                                                         kv_heads * self.head_dim],
                                    options.qkv_bias, quant_method, splits, parallel)
        self.o_proj = LinearLayer(heads * self.head_dim, [config.hidden_size], options.o_bias, quant_method,
                                  row_split(parallel), parallel)
        norm = options.qk_norm
        self.q_norm = norm(self.head_dim, config.rms_norm_eps) if norm is not None else None
        self.k_norm = norm(self.head_dim, config.rms_norm_eps) if norm is not None else None
        self._fused = False
        self.attn = attn_backend_cls(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            scale=options.scale if options.scale is not None else self.head_dim**-0.5,
            sliding_window=config.sliding_window_for(layer_idx),
        )

    @property
    def fused(self) -> bool:
        """True once ``use_cpu_kernels`` took the in-place rotary."""
        return self._fused

    @property
    def gemma_qk_norm(self) -> bool:
        """True when the q/k norms are Gemma's (the scale ``1 + weight`` in float32)."""
        return isinstance(self.q_norm, GemmaRMSNorm)

    def use_cpu_kernels(self) -> bool:
        """Norm (``tandem.kernels.cpu_ops.head_rms_norm``) and rotate
        (``rotary_neox``) q and k in place, one C++ pass each, from now on, when the rotary is
        full-width and the q/k norms (if any) are the plain or Gemma RMSNorm; True when it does.
        CPU tensors only (the pass of ``tandem.models.cpu_fusion``)."""
        self._fused = self.rotary_dim == self.head_dim and type(self.q_norm) in (type(None), RMSNorm, GemmaRMSNorm)
        return self._fused

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        q_size, kv_size, _ = self.split_sizes
        qk = qkv[:, : q_size + kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self._fused and qk.dtype == self.q_norm.weight.dtype:
            # in place on the projection's fresh output
            cpu_ops.head_rms_norm(qk[:, : self.num_heads], self.q_norm.weight, self.q_norm.eps, self.gemma_qk_norm)
            cpu_ops.head_rms_norm(qk[:, self.num_heads :], self.k_norm.weight, self.k_norm.eps, self.gemma_qk_norm)
        elif self.q_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q)[0], self.k_norm(k)[0]), dim=1)
        # q and k sit side by side in the fused output: rotate them as one tensor (half the ops).
        if self.use_rope and self._fused:
            cpu_ops.rotary_neox(qk, cos, sin)  # in place
        elif self.use_rope and self.rotary_dim == self.head_dim:
            qk = rotate(qk, cos, sin)
        elif self.use_rope:  # partial rotary: the leading rotary_dim dimensions turn, the rest pass
            qk = torch.cat((rotate(qk[..., : self.rotary_dim], cos, sin), qk[..., self.rotary_dim :]), dim=-1)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, q_size + kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.attn.forward(q, k, v, kv_cache[:, self.kv_index], metadata)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))
