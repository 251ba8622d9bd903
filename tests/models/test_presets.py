"""Model presets: the folders load in transformers as they are, tokenize and render chats, are
deterministic, are not rebuilt needlessly, and bench-100m has exactly the
shape of docs/architecture.md §4."""
from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tandem.models.presets import MARKER_FILE, default_model_path, make_demo_model
from tests.helpers.tiny_models import load_tiny_model


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return make_demo_model("demo", tmp_path_factory.mktemp("presets") / "demo")


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_demo_loads_in_transformers_as_a_small_gqa_llama(demo_dir):
    hf = AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32)
    cfg = hf.config
    assert type(hf).__name__ == "LlamaForCausalLM"
    assert 2048 <= cfg.vocab_size <= 4096 and 128 <= cfg.hidden_size <= 256
    assert 2 <= cfg.num_hidden_layers <= 4
    assert cfg.num_key_value_heads < cfg.num_attention_heads
    tok = AutoTokenizer.from_pretrained(demo_dir)
    assert len(tok) == cfg.vocab_size


def test_demo_logits_in_tandem_match_transformers(demo_dir):
    from tandem.models.config import kv_cache_shape
    from tests.helpers.paged_batch import SeqSpec, build_metadata, positions_of

    tok = AutoTokenizer.from_pretrained(demo_dir)
    ids = tok.encode("def greet(name):\n    return f'hello {name}'")
    hf = AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32).eval()
    model, arch = load_tiny_model(demo_dir)
    seqs = [SeqSpec(list(range(1, 1 + -(-len(ids) // 16))), 0, len(ids))]
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), positions_of(seqs), torch.zeros(kv_cache_shape(arch, 8, 16)),
                       build_metadata(seqs, 16))
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(model.compute_logits(hidden), ref, atol=1e-4, rtol=1e-4)


def test_demo_tokenizer_round_trips_and_renders_the_chat_template(demo_dir):
    tok = AutoTokenizer.from_pretrained(demo_dir)
    text = "class Point:\n    x: float = 0.5  # naïve ✓"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == ("<|bos|><|start_header|>system<|end_header|>\n\nBe brief.<|eot|>"
                        "<|start_header|>user<|end_header|>\n\nHi!<|eot|>"
                        "<|start_header|>assistant<|end_header|>\n\n")
    chat_ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert chat_ids.count(tok.bos_token_id) == 1


def test_demo_generation_config_names_eos_and_end_of_turn(demo_dir):
    gen = json.loads((demo_dir / "generation_config.json").read_text())
    tok = AutoTokenizer.from_pretrained(demo_dir)
    assert gen["eos_token_id"] == [tok.eos_token_id, tok.convert_tokens_to_ids("<|eot|>")]


def test_demo_is_deterministic_and_not_rebuilt(demo_dir, tmp_path):
    weights = demo_dir / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert make_demo_model("demo", demo_dir) == demo_dir
    assert weights.stat().st_mtime_ns == mtime
    again = make_demo_model("demo", tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert digest(again / name) == digest(demo_dir / name), name


def test_an_interrupted_build_is_redone(demo_dir, tmp_path):
    folder = make_demo_model("demo", tmp_path / "partial")
    (folder / MARKER_FILE).unlink()
    (folder / "model.safetensors").write_bytes(b"truncated")
    make_demo_model("demo", folder)
    assert digest(folder / "model.safetensors") == digest(demo_dir / "model.safetensors")


def test_unknown_preset_lists_the_presets(tmp_path):
    with pytest.raises(ValueError, match="demo, bench-100m"):
        make_demo_model("huge", tmp_path)


def test_default_model_path_builds_once_under_the_cache_dir(monkeypatch, tmp_path, demo_dir):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    path = default_model_path("demo")
    assert path == tmp_path / "models" / "demo"
    assert digest(path / "model.safetensors") == digest(demo_dir / "model.safetensors")
    assert default_model_path("demo") == path
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["demo"]


@pytest.mark.slow
def test_bench_100m_has_the_architecture_of_the_spec(tmp_path):
    path = make_demo_model("bench-100m", tmp_path / "bench")
    cfg = AutoConfig.from_pretrained(path)
    assert cfg.architectures == ["LlamaForCausalLM"]
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (768, 2048, 8)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (12, 4, 32000)
    assert cfg.max_position_embeddings == 4096 and not cfg.tie_word_embeddings
    assert len(AutoTokenizer.from_pretrained(path)) == 32000
    with safe_open(path / "model.safetensors", framework="pt") as f:
        shapes = {name: f.get_slice(name).get_shape() for name in f.keys()}
        dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}
    assert dtypes == {"F32"}
    assert shapes["lm_head.weight"] == [32000, 768]
    assert shapes["model.layers.7.self_attn.k_proj.weight"] == [256, 768]
    num_params = sum(torch.Size(s).numel() for s in shapes.values())
    assert 95e6 < num_params < 105e6
