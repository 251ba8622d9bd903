"""Gemma 3 (text: ``Gemma3ForCausalLM``, the 1B model and text-only checkpoints).

The Llama network with these differences, each as HF's Gemma3 implements it:

- every norm is ``GemmaRMSNorm`` (weight stored minus one, scaled in float32), and each layer has
  four: around attention (``input_layernorm`` before, ``post_attention_layernorm`` after, then
  the residual add) and around the MLP (``pre_feedforward_layernorm``,
  ``post_feedforward_layernorm``)::

      x = x + post_attention_layernorm(attn(input_layernorm(x)))
      x = x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))

- per-head q/k norms before the rotary embedding, and scores scaled by
  ``query_pre_attn_scalar ** -0.5``;
- the embeddings are multiplied by ``sqrt(hidden_size)`` (rounded to the model's dtype);
- sliding-window layers (``layer_types``, or every layer but each ``sliding_window_pattern``-th)
  use their own rotary base (``rope_local_base_freq``), full layers the global one;
- the MLP's activation is ``gelu_pytorch_tanh``; the LM head is tied to the embeddings.

Gemma 2's logit soft-capping is not implemented: a config that sets it is refused.
"""
from __future__ import annotations

import torch
from torch import nn

from tandem.interfaces import AttentionBackend, AttentionMetadata, QuantMethod
from tandem.models.config import SLIDING_ATTENTION, ModelArchConfig
from tandem.models.layers import AttentionOptions, GemmaRMSNorm
from tandem.models.llama import LlamaDecoderLayer, LlamaForCausalLM, PipelineStage
from tandem.models.rotary import RotaryEmbedding


class Gemma3DecoderLayer(LlamaDecoderLayer):
    """Llama's layer with Gemma norms and two more around the MLP (a different forward)."""

    def __init__(self, config: ModelArchConfig, layer_idx: int, quant_method: QuantMethod,
                 attn_backend_cls: type[AttentionBackend], options: AttentionOptions) -> None:
        super().__init__(config, layer_idx, quant_method, attn_backend_cls, options, norm_cls=GemmaRMSNorm)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,  # type: ignore[override]
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x)[0], cos, sin, kv_cache, metadata)
        x = x + self.post_attention_layernorm(h)[0]
        h = self.mlp(self.pre_feedforward_layernorm(x)[0])
        return x + self.post_feedforward_layernorm(h)[0]


class Gemma3Model(PipelineStage):
    intermediate_count = 1  # the residual stream only: Gemma's layers add their own

    def __init__(self, config: ModelArchConfig, quant_method: QuantMethod,
                 attn_backend_cls: type[AttentionBackend], options: AttentionOptions) -> None:
        super().__init__()
        self.build_stage(config, quant_method, lambda i: Gemma3DecoderLayer(config, i, quant_method, attn_backend_cls, options))
        # HF keeps sqrt(hidden) as a float32 buffer and casts it to the weights' dtype.
        scale = torch.tensor(config.hidden_size**0.5, dtype=torch.float32).to(torch.get_default_dtype())
        self.register_buffer("embed_scale", scale, persistent=False)
        self.rotary_emb = RotaryEmbedding(config.rotary_dim or config.head_dim, config.rope_theta,
                                          config.rope_scaling)
        self.rotary_emb_local = None
        if config.sliding_rope is not None:
            self.rotary_emb_local = RotaryEmbedding(config.rotary_dim or config.head_dim, *config.sliding_rope)
        self.layer_is_sliding = [t == SLIDING_ATTENTION for t in config.layer_types]
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps) if self.is_last_stage else None
        self.decode_loop = None
        """The stage's layers as one C++ call for decode steps (``tandem.models.cpu_decode_loop``)."""

    @property
    def local_rope_layers(self) -> list[bool]:
        """Per layer of this stage, whether it takes the local rotary tables (a sliding layer
        where the config gives sliding layers a rotary base of their own)."""
        sliding = self.layer_is_sliding[self.stage.start : self.stage.stop]
        return [s and self.rotary_emb_local is not None for s in sliding]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, intermediate: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed_tokens(input_ids) * self.embed_scale if intermediate is None else intermediate[0]
        rope = self.rotary_emb(positions, h.dtype, metadata)
        local = rope if self.rotary_emb_local is None else self.rotary_emb_local(positions, h.dtype, metadata)
        if self.decode_loop is not None and self.decode_loop.can_run(h, kv_cache, metadata):
            h, _ = self.decode_loop(h, None, *rope, kv_cache, metadata, local=local)
            if self.decode_loop.final_norm is not None:
                return h
        else:
            sliding = self.layer_is_sliding[self.stage.start : self.stage.stop]
            for layer, is_sliding in zip(self.stage_layers(), sliding):
                h = layer(h, *(local if is_sliding else rope), kv_cache, metadata)
        if not self.is_last_stage:
            return h.unsqueeze(0)
        return self.norm(h)[0]


class Gemma3ForCausalLM(LlamaForCausalLM):
    def build_model(self, config: ModelArchConfig, quant_method: QuantMethod,
                    attn_backend_cls: type[AttentionBackend]) -> nn.Module:
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(config, name) is not None:
                raise ValueError(f"{name} = {getattr(config, name)} is not supported (Gemma 2's "
                                 "logit soft-capping); tandem runs Gemma 3, which has none")
        return Gemma3Model(config, quant_method, attn_backend_cls, self.attention_options(config))

    @staticmethod
    def attention_options(config: ModelArchConfig) -> AttentionOptions:
        scalar = config.query_pre_attn_scalar or config.head_dim
        return AttentionOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias,
                                qk_norm=GemmaRMSNorm, scale=scalar**-0.5)
