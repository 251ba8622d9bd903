"""A GGUF file's metadata as the config.json of the same model (transformers' spelling), which
``ModelArchConfig.from_dict`` then reads like any other; and its generation defaults.

llama.cpp writes the shapes under ``{arch}.*`` keys (``llama.block_count``, ...); what it leaves
out is what llama.cpp hard-codes for the architecture, and is filled in here the same way:

- ``head_dim``: ``attention.key_length``, else hidden / heads; the rotary width
  ``rope.dimension_count`` (default: the whole head) becomes ``partial_rotary_factor``;
- tied embeddings: no ``output.weight`` tensor; q/k/v biases: an ``attn_q.bias`` tensor;
- Gemma 3: the sliding window's layer pattern (every 6th layer global unless
  ``attention.sliding_window_pattern`` says otherwise), the local rope base
  (``rope.freq_base_swa``, else 10000), GELU-tanh, and scores scaled by ``key_length ** -0.5``.

Refused with a ValueError naming the file: an architecture not in ``GGUF_ARCHITECTURES``, a rope
scaling other than none/linear, per-dimension rope factors (a ``rope_freqs`` tensor: Llama 3.1's
scaling), and per-layer head counts.
"""
from __future__ import annotations

from typing import Any

from tandem.models.gguf_file import GGUFFile

GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}
"""GGUF ``general.architecture`` → (the tandem/HF architecture class name, HF model_type).
llama.cpp converts Mistral checkpoints as ``llama`` (the same network here)."""

GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0

_SAMPLING_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                  "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
                  "general.sampling.penalty_repeat": "repetition_penalty"}


def gguf_config_dict(file: GGUFFile) -> dict[str, Any]:
    """The config.json of ``file``'s model."""
    arch = file.architecture
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{file.path.name}: GGUF architecture {arch!r} is not supported; "
                         f"supported: {', '.join(GGUF_ARCHITECTURES)}")
    if "rope_freqs.weight" in file.tensor_names:
        raise ValueError(f"{file.path.name}: per-dimension rope factors (rope_freqs.weight, Llama 3.1's "
                         "rope scaling) are not supported in GGUF files; serve the Hugging Face checkpoint")
    cls, model_type = GGUF_ARCHITECTURES[arch]
    cfg = _common(file) | {"architectures": [cls], "model_type": model_type}
    if arch == "gemma3":
        cfg |= _gemma3(file, cfg)
    return cfg


def _common(file: GGUFFile) -> dict[str, Any]:
    key = file.arch_key
    hidden, heads = _int(file, "embedding_length"), _int(file, "attention.head_count")
    kv_heads = key("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        raise ValueError(f"{file.path.name}: per-layer KV head counts are not supported")
    head_dim = int(key("attention.key_length") or hidden // heads)
    rotary = int(key("rope.dimension_count") or head_dim)
    names = file.tensor_names
    cfg = {
        "hidden_size": hidden,
        "intermediate_size": _int(file, "feed_forward_length"),
        "num_hidden_layers": _int(file, "block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "partial_rotary_factor": rotary / head_dim,
        "vocab_size": int(key("vocab_size") or file.metadata["tokenizer.ggml.tokens"]),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(file),
        "max_position_embeddings": int(key("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "sliding_window": key("attention.sliding_window"),
        "bos_token_id": file.metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": file.metadata.get("tokenizer.ggml.eos_token_id"),
    }
    if cfg["sliding_window"] is not None:
        cfg["sliding_window"] = int(cfg["sliding_window"])
    dtype = _FILE_DTYPES.get(file.metadata.get("general.file_type"))
    if dtype is not None:
        cfg["torch_dtype"] = dtype
    return cfg


_FILE_DTYPES = {0: "float32", 1: "float16", 32: "bfloat16"}
"""``general.file_type`` (llama.cpp's LLAMA_FTYPE) of unquantized files → the checkpoint dtype;
a quantized file has none (the serving dtype then follows the device)."""


def _gemma3(file: GGUFFile, cfg: dict[str, Any]) -> dict[str, Any]:
    layers = cfg["num_hidden_layers"]
    pattern = file.arch_key("attention.sliding_window_pattern", GEMMA3_SLIDING_WINDOW_PATTERN)
    if isinstance(pattern, list):  # one flag per layer: whether it slides
        layer_types = ["sliding_attention" if slides else "full_attention" for slides in pattern]
    else:
        layer_types = ["full_attention" if (i + 1) % int(pattern) == 0 else "sliding_attention"
                       for i in range(layers)]
    return {
        "layer_types": layer_types if cfg["sliding_window"] is not None else None,
        "rope_local_base_freq": float(file.arch_key("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE)),
        "query_pre_attn_scalar": cfg["head_dim"],
        "hidden_activation": "gelu_pytorch_tanh",
        "attn_logit_softcapping": file.arch_key("attn_logit_softcapping"),
        "final_logit_softcapping": file.arch_key("final_logit_softcapping"),
    }


def _rope_scaling(file: GGUFFile) -> dict[str, Any] | None:
    kind = file.arch_key("rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(file.arch_key("rope.scaling.factor"))}
    raise ValueError(f"{file.path.name}: rope scaling {kind!r} is not supported in GGUF files (none, linear)")


def _int(file: GGUFFile, name: str) -> int:
    value = file.arch_key(name)
    if value is None:
        raise ValueError(f"{file.path.name}: the metadata has no {file.architecture}.{name}")
    return int(value)


def gguf_generation_config(file: GGUFFile) -> dict[str, Any]:
    """What generation_config.json would say: ``eos_token_ids`` (the end-of-sequence, -turn and
    -message tokens the file names) and the sampling defaults of its ``general.sampling.*`` keys
    (as ``tandem.models.loader.GENERATION_DEFAULT_FIELDS``)."""
    meta = file.metadata
    eos = {meta[f"tokenizer.ggml.{name}_token_id"] for name in ("eos", "eot", "eom")
           if meta.get(f"tokenizer.ggml.{name}_token_id") is not None}
    sampling = {field: meta[key] for key, field in _SAMPLING_KEYS.items() if key in meta}
    return {**sampling, "eos_token_ids": {int(i) for i in eos}}
