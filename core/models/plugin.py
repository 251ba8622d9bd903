"""Registers tandem's built-in model classes by architecture name (entry point ``builtin_models``)."""
from __future__ import annotations

import tandem
from tandem.hookspecs import Register
from tandem.models.gemma3 import Gemma3ForCausalLM
from tandem.models.llama import LlamaForCausalLM
from tandem.models.qwen2 import Qwen2ForCausalLM
from tandem.models.qwen3 import Qwen3ForCausalLM


@tandem.hookimpl
def tandem_register_models(register: Register) -> None:
    register("LlamaForCausalLM", LlamaForCausalLM)
    register("MistralForCausalLM", LlamaForCausalLM)
    register("Qwen2ForCausalLM", Qwen2ForCausalLM)
    register("Qwen3ForCausalLM", Qwen3ForCausalLM)
    register("Gemma3ForCausalLM", Gemma3ForCausalLM)
    register("GraniteForCausalLM", LlamaForCausalLM)
    register("SmolLM3ForCausalLM", LlamaForCausalLM)
    register("Phi3ForCausalLM", LlamaForCausalLM)
