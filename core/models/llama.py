"""Llama (also Mistral: the same network with a sliding window) over the paged KV pool.

Contract shared by every tandem model class::

    model = Cls(config: ModelArchConfig, quant_method: QuantMethod, attn_backend_cls)
    hidden = model(input_ids [T], positions [T], kv_cache, metadata)     # [T, hidden_size]
    logits = model.compute_logits(hidden [N, hidden_size])               # float32 [N, vocab]
    model.load_weights(iterable of (HF checkpoint name, tensor))         # once, all tensors

``kv_cache`` is this rank's pool ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``;
layer ``l`` hands ``kv_cache[:, l - first layer of the stage]`` to its attention backend. Module
names follow HF's, except the fused projections: ``self_attn.qkv_proj`` (q, k, v) and
``mlp.gate_up_proj`` (gate, up).

Pipeline parallelism (``tandem.distributed``): a rank builds only its stage's layers (the
others are ``MissingLayer`` placeholders, so module names keep their global layer numbers),
the embedding on the first stage, the final norm and LM head on the last (and the embedding
there too when the head is tied to it). A stage after the first is called with
``intermediate``, the stacked hidden state and residual ``[2, T, hidden]`` the previous stage
returned; every stage but the last returns that instead of the final hidden state, and
``load_weights`` skips the tensors of layers other stages hold.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tandem.distributed import current
from tandem.interfaces import AttentionBackend, AttentionMetadata, QuantMethod
from tandem.models.config import ModelArchConfig
from tandem.models.layers import (
    Attention,
    AttentionOptions,
    Embedding,
    GatedMLP,
    LinearLayer,
    LMHead,
    RMSNorm,
    make_embedding,
    make_lm_head,
)
from tandem.models.rotary import RotaryEmbedding

# checkpoint module name → (fused module name, shard index)
FUSED_SHARDS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# Fused projections some checkpoints (Phi-3) store as one tensor.
FUSED_NAMES = ("qkv_proj", "gate_up_proj")
# Tensors some checkpoints carry that the model recomputes, and FP8 checkpoints' KV-cache scales
# (tandem's KV cache stays in the model's dtype).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "self_attn.k_scale", "self_attn.v_scale", "self_attn.kv_scale",
                    "k_proj.output_scale", "v_proj.output_scale")


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelArchConfig, layer_idx: int, quant_method: QuantMethod,
                 attn_backend_cls: type[AttentionBackend], options: AttentionOptions,
                 norm_cls: type[RMSNorm] = RMSNorm) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx, quant_method, attn_backend_cls, options)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias,
                            config.hidden_act, quant_method)
        self.input_layernorm = norm_cls(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = norm_cls(config.hidden_size, config.rms_norm_eps)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the MLP's output and the residual stream; the next norm adds them."""
        h, residual = self.input_layernorm(x, residual)
        h = self._scaled(self.self_attn(h, cos, sin, kv_cache, metadata))
        h, residual = self.post_attention_layernorm(h, residual)
        return self._scaled(self.mlp(h)), residual

    def _scaled(self, h: torch.Tensor) -> torch.Tensor:
        return h if self.residual_multiplier == 1.0 else h * self.residual_multiplier


class MissingLayer(nn.Module):
    """Stands for a layer another pipeline stage holds (no parameters, never called)."""


class PipelineStage(nn.Module):
    """What every decoder stack shares under pipeline parallelism: which layers, embedding and
    final norm this rank builds (``build_stage``), and the names of the checkpoint tensors it
    leaves to other stages (``held_elsewhere``)."""

    intermediate_count = 2
    """Tensors a stage hands the next, each ``[T, hidden_size]`` (hidden state and residual)."""

    def build_stage(self, config: ModelArchConfig, quant_method: QuantMethod, make_layer) -> None:
        parallel = current()
        self.stage = parallel.stage_layers(config.num_hidden_layers)
        self.is_first_stage, self.is_last_stage = parallel.is_first_stage, parallel.is_last_stage
        needs_embedding = self.is_first_stage or (self.is_last_stage and config.tie_word_embeddings)
        self.embed_tokens = (make_embedding(config.vocab_size, config.hidden_size, quant_method)
                             if needs_embedding else None)
        self.layers = nn.ModuleList(make_layer(i) if i in self.stage else MissingLayer()
                                    for i in range(config.num_hidden_layers))

    def held_elsewhere(self, prefix: str) -> tuple[str, ...]:
        """Name prefixes (under ``prefix``) of the checkpoint tensors other stages load."""
        names = [f"{prefix}layers.{i}." for i, layer in enumerate(self.layers) if isinstance(layer, MissingLayer)]
        if self.embed_tokens is None:
            names.append(f"{prefix}embed_tokens.")
        if self.norm is None:
            names.append(f"{prefix}norm.")
        return tuple(names)

    def stage_layers(self):
        return self.layers[self.stage.start : self.stage.stop]


class LlamaModel(PipelineStage):
    def __init__(self, config: ModelArchConfig, quant_method: QuantMethod,
                 attn_backend_cls: type[AttentionBackend], options: AttentionOptions) -> None:
        super().__init__()
        self.build_stage(config, quant_method, lambda i: LlamaDecoderLayer(config, i, quant_method, attn_backend_cls, options))
        self.rotary_emb = RotaryEmbedding(config.rotary_dim or config.head_dim, config.rope_theta,
                                          config.rope_scaling)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if self.is_last_stage else None
        self.embedding_multiplier = config.embedding_multiplier
        self.decode_loop = None
        """The stage's layers as one C++ call for decode steps (``tandem.models.cpu_decode_loop``)."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, intermediate: torch.Tensor | None = None) -> torch.Tensor:
        if intermediate is None:
            h, residual = self.embed_tokens(input_ids), None
            if self.embedding_multiplier != 1.0:
                h = h * self.embedding_multiplier
        else:
            h, residual = intermediate[0], intermediate[1]
        cos, sin = self.rotary_emb(positions, h.dtype, metadata)
        if self.decode_loop is not None and self.decode_loop.can_run(h, kv_cache, metadata):
            h, residual = self.decode_loop(h, residual, cos, sin, kv_cache, metadata)
            if self.decode_loop.final_norm is not None:
                return h
        else:
            for layer in self.stage_layers():
                h, residual = layer(h, residual, cos, sin, kv_cache, metadata)
        if not self.is_last_stage:
            return torch.stack((h, residual))
        h, _ = self.norm(h, residual)
        return h


class LlamaForCausalLM(nn.Module):
    """Llama, Mistral, and the Llama-shaped families that only set config values: Granite's
    multipliers (``embedding_multiplier``, ``residual_multiplier``, ``attention_multiplier``,
    ``logits_scaling``) and SmolLM3's rope-free layers (``no_rope_layers``). q, k, v and o carry a
    bias when config.attention_bias says so; subclasses for other members of the family override
    ``attention_options`` or ``build_model``. Phi-3 is this class too: its fused checkpoint
    tensors are split on load, and ``partial_rotary_factor`` / longrope come from the config."""

    def __init__(self, config: ModelArchConfig, quant_method: QuantMethod,
                 attn_backend_cls: type[AttentionBackend]) -> None:
        super().__init__()
        self.config = config
        self.model = self.build_model(config, quant_method, attn_backend_cls)
        tied_to = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = (make_lm_head(config.vocab_size, config.hidden_size, quant_method, tied_to)
                        if self.model.is_last_stage else None)

    def build_model(self, config: ModelArchConfig, quant_method: QuantMethod,
                    attn_backend_cls: type[AttentionBackend]) -> nn.Module:
        """The decoder stack (``self.model``): embeddings, layers, final norm."""
        return LlamaModel(config, quant_method, attn_backend_cls, self.attention_options(config))

    @staticmethod
    def attention_options(config: ModelArchConfig) -> AttentionOptions:
        return AttentionOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias,
                                scale=config.attention_multiplier)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, intermediate: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, kv_cache, metadata, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits; None on tensor ranks other than 0 (they hold a vocabulary shard)."""
        logits = self.lm_head(hidden)
        scaling = self.config.logits_scaling
        return logits if scaling == 1.0 or logits is None else logits / scaling

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load every tensor of an HF checkpoint (names as HF writes them), then let the quant
        method post-process each linear layer. Raises ValueError on an unknown tensor name, and
        on parameters or linear shards the checkpoint did not provide."""
        modules = dict(self.named_modules())
        params = dict(self.named_parameters())
        loaded_params: set[str] = set()
        loaded_shards: set[tuple[str, int, bool]] = set()
        elsewhere = self.model.held_elsewhere("model.") + (("lm_head.",) if self.lm_head is None else ())
        with torch.no_grad():
            for name, tensor in weights:
                if (name.endswith(IGNORED_SUFFIXES) or name.startswith(elsewhere)
                        or (name.startswith("lm_head.") and self.lm_head.tied)):
                    continue
                module_name, _, suffix = name.rpartition(".")
                parent, _, leaf = module_name.rpartition(".")
                fused, shard = FUSED_SHARDS.get(leaf, (leaf, 0))
                target = f"{parent}.{fused}" if parent else fused
                module = modules.get(target)
                if isinstance(module, LinearLayer) and leaf in FUSED_NAMES and len(module.output_sizes) > 1:
                    # Phi-3 stores qkv_proj / gate_up_proj already fused: split it into the shards
                    for shard, part in enumerate(_split_fused(name, suffix, tensor, module)):
                        module.load(suffix, part, shard)
                        loaded_shards.add((target, shard, suffix == "bias"))
                elif isinstance(module, LinearLayer):
                    try:
                        module.load(suffix, tensor, shard)
                    except ValueError as exc:
                        raise ValueError(f"{target} ({name}): {exc}") from exc
                    loaded_shards.add((target, shard, suffix == "bias"))
                elif isinstance(module, (Embedding, LMHead)) and suffix == "weight":
                    try:
                        module.load(tensor)
                    except ValueError as exc:
                        raise ValueError(f"checkpoint tensor {name!r} {exc}") from exc
                    loaded_params.add(name)
                elif name in params:
                    _copy_param(name, params[name], tensor)
                    loaded_params.add(name)
                else:
                    raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {type(self).__name__}")
            self._check_complete(modules, params, loaded_params, loaded_shards)
            for module in modules.values():
                if isinstance(module, LinearLayer):
                    module.quant_method.process_weights_after_loading(module)

    def _check_complete(self, modules: dict[str, nn.Module], params: dict[str, nn.Parameter],
                        loaded_params: set[str], loaded_shards: set[tuple[str, int, bool]]) -> None:
        missing = []
        for name, module in modules.items():
            if isinstance(module, LinearLayer):
                kinds = (False, True) if module.bias is not None else (False,)
                missing += [f"{name} shard {i}{' bias' if is_bias else ''}"
                            for i in range(len(module.output_sizes)) for is_bias in kinds
                            if (name, i, is_bias) not in loaded_shards]
        linear_prefixes = tuple(f"{n}." for n, m in modules.items() if isinstance(m, LinearLayer))
        missing += [n for n in params if n not in loaded_params and not n.startswith(linear_prefixes)]
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise ValueError(f"the checkpoint lacks weights for {shown}")


def _split_fused(name: str, suffix: str, tensor: torch.Tensor, module: LinearLayer) -> list[torch.Tensor]:
    if suffix not in ("weight", "bias") or module.quant_method.name != "unquantized":
        raise ValueError(f"checkpoint tensor {name!r}: fused projections are only read unquantized")
    sizes = module.full_output_sizes  # the checkpoint's: tensor-parallel ranks cut each shard later
    if tensor.shape[0] != sum(sizes):
        raise ValueError(f"checkpoint tensor {name!r} has {tensor.shape[0]} rows, expected "
                         f"{' + '.join(map(str, sizes))}")
    return list(tensor.split(sizes, dim=0))


def _copy_param(name: str, param: nn.Parameter, tensor: torch.Tensor) -> None:
    if tuple(tensor.shape) != tuple(param.shape):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(tensor)
