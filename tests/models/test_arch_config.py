"""ModelArchConfig parsing (both config.json spellings) and the KV pool size helpers, checked
against hand-written config dicts and hand-computed sizes."""
from __future__ import annotations

import json

import pytest
import torch

from tandem.models.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ModelArchConfig,
    RopeScaling,
    kv_bytes_per_block,
    kv_cache_shape,
)

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

LLAMA3_PARAMS = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}


def test_transformers_4_and_5_spellings_parse_the_same():
    v4 = {**BASE, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **LLAMA3_PARAMS},
          "torch_dtype": "bfloat16"}
    v5 = {**BASE, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3_PARAMS},
          "dtype": "bfloat16"}
    a, b = ModelArchConfig.from_dict(v4), ModelArchConfig.from_dict(v5)
    assert a == b
    assert a.rope_theta == 500000.0
    assert a.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert a.torch_dtype == "bfloat16"


def test_old_rope_scaling_type_key_and_linear_scaling():
    cfg = ModelArchConfig.from_dict({**BASE, "rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert cfg.rope_scaling == RopeScaling("linear", 2.0)


def test_defaults_when_optional_fields_are_absent():
    cfg = ModelArchConfig.from_dict({k: v for k, v in BASE.items() if k != "num_key_value_heads"})
    assert cfg.num_key_value_heads == 8
    assert cfg.head_dim == 32
    assert cfg.rope_theta == 10000.0 and cfg.rope_scaling is None
    assert cfg.sliding_window is None and cfg.layer_types == (FULL_ATTENTION,) * 3
    assert not cfg.tie_word_embeddings and not cfg.attention_bias
    assert cfg.eos_token_ids == (2,)
    assert cfg.quantization_config == {}
    assert cfg.max_model_len == 4096


def test_explicit_head_dim_and_eos_list():
    cfg = ModelArchConfig.from_dict({**BASE, "head_dim": 64, "eos_token_id": [2, 7]})
    assert cfg.head_dim == 64
    assert cfg.eos_token_ids == (2, 7)


@pytest.mark.parametrize("rope_type", ["dynamic", "yarn"])
def test_unsupported_rope_type_is_named(rope_type):
    with pytest.raises(ValueError, match=rope_type):
        ModelArchConfig.from_dict({**BASE, "rope_scaling": {"rope_type": rope_type, "factor": 2.0}})


def test_mistral_sliding_window_applies_to_every_layer():
    cfg = ModelArchConfig.from_dict({**BASE, "model_type": "mistral", "sliding_window": 16})
    assert [cfg.sliding_window_for(i) for i in range(3)] == [16, 16, 16]


def test_qwen2_use_sliding_window_false_means_no_window():
    cfg = ModelArchConfig.from_dict({**BASE, "model_type": "qwen2", "sliding_window": 4096,
                                     "use_sliding_window": False, "max_window_layers": 1})
    assert cfg.sliding_window is None
    assert [cfg.sliding_window_for(i) for i in range(3)] == [None, None, None]


def test_qwen2_slides_from_max_window_layers_on():
    cfg = ModelArchConfig.from_dict({**BASE, "model_type": "qwen2", "sliding_window": 32,
                                     "use_sliding_window": True, "max_window_layers": 2})
    assert [cfg.sliding_window_for(i) for i in range(3)] == [None, None, 32]


def test_explicit_layer_types_win():
    types = [SLIDING_ATTENTION, FULL_ATTENTION, SLIDING_ATTENTION]
    cfg = ModelArchConfig.from_dict({**BASE, "sliding_window": 8, "layer_types": types})
    assert [cfg.sliding_window_for(i) for i in range(3)] == [8, None, 8]


def test_quantization_config_is_kept():
    q = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    assert ModelArchConfig.from_dict({**BASE, "quantization_config": q}).quantization_config == q


def test_from_pretrained_dir_reads_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    assert ModelArchConfig.from_pretrained_dir(tmp_path) == ModelArchConfig.from_dict(BASE)
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelArchConfig.from_pretrained_dir(tmp_path / "missing")


def test_kv_pool_shape_and_block_bytes_of_bench_100m():
    # docs/architecture.md §2: 256 KiB per block for bench-100m (8 layers, 4 KV heads of 64).
    cfg = ModelArchConfig.from_dict({**BASE, "hidden_size": 768, "num_hidden_layers": 8,
                                     "num_attention_heads": 12, "num_key_value_heads": 4})
    assert kv_cache_shape(cfg, 100, 16) == (100, 8, 2, 16, 4, 64)
    assert kv_bytes_per_block(cfg, 16, torch.float32) == 256 * 1024
    assert kv_bytes_per_block(cfg, 16, torch.bfloat16) == 128 * 1024


GEMMA3_4X = {  # the shape of google/gemma-3-1b-it's config.json (transformers 4.50 spelling)
    **BASE, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "num_hidden_layers": 7,
    "head_dim": 64, "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
    "rope_theta": 1000000, "rope_local_base_freq": 10000, "rope_scaling": None, "sliding_window": 512,
    "sliding_window_pattern": 6, "final_logit_softcapping": None, "attn_logit_softcapping": None,
}


def test_gemma3_4x_spelling():
    cfg = ModelArchConfig.from_dict(GEMMA3_4X)
    assert cfg.layer_types == (SLIDING_ATTENTION,) * 5 + (FULL_ATTENTION, SLIDING_ATTENTION)
    assert [cfg.sliding_window_for(i) for i in (0, 5, 6)] == [512, None, 512]
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.sliding_rope) == (1e6, None, (1e4, None))
    assert cfg.hidden_act == "gelu_pytorch_tanh" and cfg.query_pre_attn_scalar == 256
    assert cfg.tie_word_embeddings  # Gemma's default when config.json leaves it out


def test_rope_parameters_per_layer_type():
    params = {"full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    cfg = ModelArchConfig.from_dict({**BASE, "rope_parameters": params})
    assert (cfg.rope_theta, cfg.rope_scaling) == (1e6, RopeScaling("linear", 8.0))
    assert cfg.sliding_rope == (1e4, None)
    with pytest.raises(ValueError, match="layer types"):
        ModelArchConfig.from_dict({**BASE, "rope_parameters": {"chunked_attention": {"rope_theta": 1.0}}})


def test_gemma2_soft_capping_is_refused():
    from tandem.models.gemma3 import Gemma3ForCausalLM
    from tandem.quant.unquantized import UnquantizedLinearMethod
    from tandem.plugins.attention_torch import TorchAttentionBackend

    cfg = ModelArchConfig.from_dict({**GEMMA3_4X, "num_hidden_layers": 1, "attn_logit_softcapping": 50.0})
    with torch.device("meta"), pytest.raises(ValueError, match="attn_logit_softcapping"):
        Gemma3ForCausalLM(cfg, UnquantizedLinearMethod(), TorchAttentionBackend)
