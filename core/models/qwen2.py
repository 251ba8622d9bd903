"""Qwen2: the Llama network with a bias on q, k and v (none on o_proj), and optionally a sliding
window on the layers from ``max_window_layers`` on (``use_sliding_window``)."""
from __future__ import annotations

from tandem.models.config import ModelArchConfig
from tandem.models.layers import AttentionOptions
from tandem.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(config: ModelArchConfig) -> AttentionOptions:
        return AttentionOptions(qkv_bias=True, o_bias=False)
