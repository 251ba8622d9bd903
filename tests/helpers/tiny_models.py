"""Tiny random-weight Hugging Face checkpoints for tests, built on disk from transformers configs.

Every checkpoint is float32, deterministic (fixed seeds), has a locally trained byte-level BPE
tokenizer (vocab 512, ``<|bos|>`` prepended, a chat template) and a generation_config.json whose
``eos_token_id`` is ``[<|eos|>, <|eot|>]`` (config.json names only ``<|eos|>``). Weights are
scaled as docs/architecture.md §6 says (×3 for matrices, a further ×8 for the LM head) so that
greedy top-2 gaps are wide; norm weights and biases are randomised so that loading them matters.

Kinds (``TINY_KINDS``):
    "llama"          LlamaForCausalLM, 2 layers, hidden 64, 4 heads / 2 KV heads (head_dim 16)
    "llama3"         the same with Llama 3 rope scaling (factor 8, original context 32)
    "llama_tied"     the same with tied input/output embeddings
    "llama_sharded"  the "llama" weights saved in several safetensors shards (+ index.json)
    "qwen2"          Qwen2ForCausalLM (q/k/v bias), no sliding window
    "qwen2_sliding"  Qwen2 with use_sliding_window: layer 0 full, layer 1 window 8 (max_window_layers 1)
    "mistral"        MistralForCausalLM with sliding_window = 8
    "qwen3"          Qwen3ForCausalLM (per-head q/k RMSNorm), head_dim 32 set apart from hidden/heads
    "granite"        GraniteForCausalLM with embedding/residual/attention multipliers and logits scaling
    "smollm3"        SmolLM3ForCausalLM, 4 layers, the last without rotary embedding (no_rope_layers)
    "phi3"           Phi3ForCausalLM (fused qkv/gate_up tensors), partial rotary 0.75
    "phi3_longrope"  Phi3 with longrope (original context 32, max 512) and partial rotary 0.5
    "gemma3"         Gemma3ForCausalLM, 4 layers (full attention in layer 2, window 8 elsewhere, with
                     their own rope base), query_pre_attn_scalar 24, tied embeddings, GELU-tanh MLP

API:
    tiny_model_dir(kind) -> Path       built once per process into a temporary folder, cached
    is_tiny_model_dir(path) -> bool    whether path is one of those folders
    build_tiny_model(path, kind) -> Path
    tiny_tokenizer() -> PreTrainedTokenizerFast   (cached; the tokenizer every kind ships)
    hf_model(path) -> transformers model, float32, eval mode (the oracle)
    builtin_registry() -> StaticRegistry   the built-in models, "torch" backend and "unquantized"
                                           method, registered through their plugin modules' hooks
    load_tiny_model(path, dtype=torch.float32, device="cpu") -> (model, ModelArchConfig)  tandem's model

Fixtures (import them into a test module, e.g. ``from tests.helpers.tiny_models import
tiny_llama_dir``): tiny_llama_dir, tiny_llama3_dir, tiny_llama_tied_dir, tiny_llama_sharded_dir,
tiny_qwen2_dir, tiny_qwen2_sliding_dir, tiny_mistral_dir, tiny_qwen3_dir, tiny_gemma3_dir — each a Path to the folder.
"""
from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GraniteConfig,
    GraniteForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

from tandem.models.config import ModelArchConfig
from tandem.models.loader import load_model
from tandem.models.tokenizer_training import EOS, EOT, stdlib_corpus_files, train_bpe_tokenizer

TINY_VOCAB = 512
TINY_KINDS = ("llama", "llama3", "llama_tied", "llama_sharded", "qwen2", "qwen2_sliding", "mistral", "qwen3",
              "gemma3", "granite", "smollm3", "phi3", "phi3_longrope", "llama_mqa")
SLIDING_WINDOW = 8
MATRIX_SCALE = 3.0
LM_HEAD_SCALE = 8.0

_COMMON = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
)


@functools.cache
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    return train_bpe_tokenizer(TINY_VOCAB, stdlib_corpus_files(8))


def _special_ids() -> dict[str, int]:
    tok = tiny_tokenizer()
    return {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id}


def _config_and_class(kind: str) -> tuple[PreTrainedConfig, type]:
    ids = _special_ids()
    if kind in ("llama", "llama_sharded"):
        return LlamaConfig(**_COMMON, **ids), LlamaForCausalLM
    if kind == "llama_mqa":  # one KV head (replicated under tensor parallelism), an odd vocabulary
        return LlamaConfig(**{**_COMMON, "num_key_value_heads": 1, "vocab_size": TINY_VOCAB + 3}, **ids), \
            LlamaForCausalLM
    if kind == "llama_tied":
        return LlamaConfig(**_COMMON, **ids, tie_word_embeddings=True), LlamaForCausalLM
    if kind == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
        return LlamaConfig(**_COMMON, **ids, rope_parameters=rope), LlamaForCausalLM
    if kind == "qwen2":
        return Qwen2Config(**_COMMON, **ids, use_sliding_window=False), Qwen2ForCausalLM
    if kind == "qwen2_sliding":
        return Qwen2Config(**_COMMON, **ids, use_sliding_window=True, sliding_window=SLIDING_WINDOW,
                           max_window_layers=1), Qwen2ForCausalLM
    if kind == "mistral":
        return MistralConfig(**_COMMON, **ids, sliding_window=SLIDING_WINDOW), MistralForCausalLM
    if kind == "qwen3":
        return Qwen3Config(**_COMMON, **ids, head_dim=32), Qwen3ForCausalLM
    if kind == "gemma3":
        layers = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
        config = Gemma3TextConfig(**{**_COMMON, "num_hidden_layers": 4}, **ids, head_dim=16,
                                  sliding_window=SLIDING_WINDOW, layer_types=layers, query_pre_attn_scalar=24)
        config.architectures = ["Gemma3ForCausalLM"]
        return config, Gemma3ForCausalLM
    if kind == "granite":
        return GraniteConfig(**_COMMON, **ids, embedding_multiplier=2.0, residual_multiplier=0.5,
                             attention_multiplier=0.1, logits_scaling=4.0), GraniteForCausalLM
    if kind == "smollm3":
        config = SmolLM3Config(**{**_COMMON, "num_hidden_layers": 4}, **ids, tie_word_embeddings=False)
        assert config.no_rope_layers == [1, 1, 1, 0]
        return config, SmolLM3ForCausalLM
    if kind == "phi3":
        return Phi3Config(**_COMMON, **ids, partial_rotary_factor=0.75), Phi3ForCausalLM
    if kind == "phi3_longrope":
        rope = {"type": "longrope", "short_factor": [1.0, 1.5, 2.5, 4.0], "long_factor": [8.0] * 4}
        config = Phi3Config(**_COMMON, **ids, partial_rotary_factor=0.5, original_max_position_embeddings=32,
                            rope_scaling=rope)
        return config, Phi3ForCausalLM
    raise ValueError(f"unknown tiny model kind {kind!r}; kinds: {', '.join(TINY_KINDS)}")


def _scale_weights(model: torch.nn.Module, tied: bool) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.mul_(MATRIX_SCALE)
                if name == "lm_head.weight" or (tied and name.endswith("embed_tokens.weight")):
                    p.mul_(LM_HEAD_SCALE)
            elif name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))


def build_tiny_model(path: str | Path, kind: str, seed: int = 0) -> Path:
    """Write the tiny checkpoint ``kind`` (see TINY_KINDS) into ``path`` and return it."""
    path = Path(path)
    config, cls = _config_and_class(kind)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = cls(config).to(torch.float32).eval()
        _scale_weights(model, config.tie_word_embeddings)
    shard = "40KB" if kind == "llama_sharded" else "1GB"
    model.save_pretrained(path, max_shard_size=shard)
    tok = tiny_tokenizer()
    tok.save_pretrained(path)
    eos_ids = [tok.eos_token_id, tok.convert_tokens_to_ids(EOT)]
    GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=eos_ids,
                     pad_token_id=tok.pad_token_id).save_pretrained(path)
    assert tok.convert_ids_to_tokens(tok.eos_token_id) == EOS
    return path


_ROOT: Path | None = None


@functools.cache
def tiny_model_dir(kind: str) -> Path:
    """The checkpoint ``kind``, built once per process under a temporary folder."""
    global _ROOT
    if _ROOT is None:
        _ROOT = Path(tempfile.mkdtemp(prefix="tandem-tiny-"))
        atexit.register(shutil.rmtree, _ROOT, True)
    return build_tiny_model(_ROOT / kind, kind)


def is_tiny_model_dir(path: str | Path) -> bool:
    """Whether ``path`` is one of ``tiny_model_dir``'s checkpoints (which no test changes)."""
    return _ROOT is not None and Path(path).parent == _ROOT


def hf_model(path: str | Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


class StaticRegistry:
    """A stand-in for ``tandem.plugin_manager.Registry``: classes by (kind, name)."""

    def __init__(self) -> None:
        self.classes: dict[tuple[str, str], type] = {}

    def register(self, kind: str, name: str, cls: type) -> None:
        self.classes[(kind, name)] = cls

    def get(self, kind: str, name: str) -> type:
        if (kind, name) not in self.classes:
            raise ValueError(f"unknown {kind} {name!r}; installed: {', '.join(self.names(kind))}")
        return self.classes[(kind, name)]

    def names(self, kind: str) -> list[str]:
        return sorted(n for k, n in self.classes if k == kind)


def builtin_registry() -> StaticRegistry:
    from tandem.models import plugin as models_plugin
    from tandem.plugins import attention as attention_plugin
    from tandem.quant import plugin as quant_plugin

    registry = StaticRegistry()
    models_plugin.tandem_register_models(register=functools.partial(registry.register, "model"))
    attention_plugin.tandem_register_attention_backends(
        register=functools.partial(registry.register, "attention_backend"))
    quant_plugin.tandem_register_quant_methods(register=functools.partial(registry.register, "quant_method"))
    return registry


def load_tiny_model(path: str | Path, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> tuple[torch.nn.Module, ModelArchConfig]:
    registry = builtin_registry()
    return load_model(path, dtype=dtype, device=torch.device(device), registry=registry,
                      attn_backend_cls=registry.get("attention_backend", "torch"),
                      quant_method=registry.get("quant_method", "unquantized")())


@pytest.fixture(scope="session")
def tiny_llama_dir() -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def tiny_llama3_dir() -> Path:
    return tiny_model_dir("llama3")


@pytest.fixture(scope="session")
def tiny_llama_tied_dir() -> Path:
    return tiny_model_dir("llama_tied")


@pytest.fixture(scope="session")
def tiny_llama_sharded_dir() -> Path:
    return tiny_model_dir("llama_sharded")


@pytest.fixture(scope="session")
def tiny_qwen2_dir() -> Path:
    return tiny_model_dir("qwen2")


@pytest.fixture(scope="session")
def tiny_qwen2_sliding_dir() -> Path:
    return tiny_model_dir("qwen2_sliding")


@pytest.fixture(scope="session")
def tiny_mistral_dir() -> Path:
    return tiny_model_dir("mistral")


@pytest.fixture(scope="session")
def tiny_qwen3_dir() -> Path:
    return tiny_model_dir("qwen3")


@pytest.fixture(scope="session")
def tiny_gemma3_dir() -> Path:
    return tiny_model_dir("gemma3")
