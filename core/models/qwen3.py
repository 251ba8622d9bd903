"""Qwen3 (dense): the Llama network with an RMSNorm over the head dimension of every query and key
head before the rotary embedding (``self_attn.q_norm``/``k_norm``, one weight of ``head_dim``
each, shared by the heads), biases as ``attention_bias`` says, ``head_dim`` usually set apart from
``hidden_size / num_attention_heads``, and Qwen2's optional sliding window."""
from __future__ import annotations

from tandem.models.config import ModelArchConfig
from tandem.models.layers import AttentionOptions, RMSNorm
from tandem.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(config: ModelArchConfig) -> AttentionOptions:
        return AttentionOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias, qk_norm=RMSNorm)
