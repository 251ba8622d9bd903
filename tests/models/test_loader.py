"""The loader: weight files (single, sharded, pytorch_model.bin), generation config, tokenizer,
architecture lookup through the registry, and its error messages."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.models.llama import LlamaForCausalLM
from tandem.models.loader import (
    checkpoint_files,
    estimate_weight_bytes,
    load_generation_config,
    load_tokenizer,
    sampling_defaults,
)
from tandem.models.qwen2 import Qwen2ForCausalLM
from tandem.plugins.attention_torch import TorchAttentionBackend
from tandem.quant.unquantized import UnquantizedLinearMethod
from tests.helpers.tiny_models import (  # noqa: F401  (fixtures)
    builtin_registry,
    load_tiny_model,
    tiny_llama_dir,
    tiny_llama_sharded_dir,
    tiny_tokenizer,
)


def copy_without_weights(src, dst):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    return dst


def assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def test_sharded_checkpoint_loads_the_same_weights_as_the_single_file(tiny_llama_dir, tiny_llama_sharded_dir):
    files = checkpoint_files(tiny_llama_sharded_dir)
    assert len(files) > 1 and files == sorted(files)
    single, arch = load_tiny_model(tiny_llama_dir)
    sharded, arch_sharded = load_tiny_model(tiny_llama_sharded_dir)
    assert arch == arch_sharded
    assert_same_state(single, sharded)


def test_loaded_weights_equal_the_checkpoint_tensors(tiny_llama_dir):
    model, _ = load_tiny_model(tiny_llama_dir)
    ckpt = load_file(tiny_llama_dir / "model.safetensors")
    qkv = model.model.layers[1].self_attn.qkv_proj.weight
    expected = torch.cat([ckpt[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(qkv, expected)
    gate_up = model.model.layers[0].mlp.gate_up_proj.weight
    assert torch.equal(gate_up, torch.cat([ckpt["model.layers.0.mlp.gate_proj.weight"],
                                           ckpt["model.layers.0.mlp.up_proj.weight"]]))
    assert torch.equal(model.lm_head.weight, ckpt["lm_head.weight"])


def test_pytorch_model_bin_is_accepted(tiny_llama_dir, tmp_path):
    folder = copy_without_weights(tiny_llama_dir, tmp_path / "bin")
    torch.save(load_file(tiny_llama_dir / "model.safetensors"), folder / "pytorch_model.bin")
    assert_same_state(load_tiny_model(folder)[0], load_tiny_model(tiny_llama_dir)[0])


def test_parameters_get_the_requested_dtype_and_the_default_dtype_is_restored(tiny_llama_dir):
    model, _ = load_tiny_model(tiny_llama_dir, dtype=torch.float16)
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    assert torch.get_default_dtype() == torch.float32
    assert not any(p.requires_grad for p in model.parameters())


def test_unsupported_architecture_names_it_and_the_supported_list(tiny_llama_dir, tmp_path):
    folder = shutil.copytree(tiny_llama_dir, tmp_path / "gpt2")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported model architecture GPT2LMHeadModel; supported: ") as err:
        load_tiny_model(folder)
    supported = str(err.value).split("supported: ")[1].split(", ")
    assert supported == sorted(supported) and {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                               "Qwen3ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM"} <= set(supported)
    assert torch.get_default_dtype() == torch.float32


def test_a_missing_tensor_is_named(tiny_llama_dir, tmp_path):
    folder = copy_without_weights(tiny_llama_dir, tmp_path / "missing")
    tensors = load_file(tiny_llama_dir / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    del tensors["model.norm.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.qkv_proj shard 1.*model\.norm\.weight"):
        load_tiny_model(folder)


def test_an_unknown_tensor_is_named(tiny_llama_dir, tmp_path):
    folder = copy_without_weights(tiny_llama_dir, tmp_path / "extra")
    tensors = load_file(tiny_llama_dir / "model.safetensors")
    tensors["model.layers.0.self_attn.mystery.weight"] = torch.zeros(2)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match="mystery"):
        load_tiny_model(folder)


def test_no_weight_file_is_an_error(tiny_llama_dir, tmp_path):
    folder = copy_without_weights(tiny_llama_dir, tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_tiny_model(folder)


def test_eos_ids_come_from_generation_config_as_a_set(tiny_llama_dir):
    tok = tiny_tokenizer()
    gen = load_generation_config(tiny_llama_dir)
    assert gen["eos_token_ids"] == {tok.eos_token_id, tok.convert_tokens_to_ids("<|eot|>")}
    assert gen["bos_token_id"] == tok.bos_token_id


def test_eos_ids_fall_back_to_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert load_generation_config(tmp_path) == {"eos_token_ids": {7}}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 3, "temperature": 0.5}))
    assert load_generation_config(tmp_path) == {"eos_token_id": 3, "temperature": 0.5, "eos_token_ids": {3}}
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": True}))
    assert load_generation_config(tmp_path)["eos_token_ids"] == {7}
    (tmp_path / "config.json").write_text(json.dumps({}))
    assert load_generation_config(tmp_path)["eos_token_ids"] == set()


def test_load_tokenizer_round_trips_text(tiny_llama_dir):
    tok = load_tokenizer(tiny_llama_dir)
    text = "for i in range(3):\n    print(i)  # é"
    ids = tok.encode(text)
    assert ids == tiny_tokenizer().encode(text) and ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_builtin_plugins_register_models_backend_and_method():
    registry = builtin_registry()
    assert registry.get("model", "LlamaForCausalLM") is LlamaForCausalLM
    assert registry.get("model", "MistralForCausalLM") is LlamaForCausalLM
    assert registry.get("model", "Qwen2ForCausalLM") is Qwen2ForCausalLM
    assert registry.get("attention_backend", "torch") is TorchAttentionBackend
    assert registry.get("quant_method", "unquantized") is UnquantizedLinearMethod


def test_a_folder_without_tokenizer_files_says_so(tiny_llama_dir, tmp_path):
    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match="no tokenizer.json, tokenizer.model or vocab.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.model").write_bytes(b"not a sentencepiece model")
    with pytest.raises(ValueError, match="pip install sentencepiece"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_bytes_are_estimated_from_the_headers(tiny_llama_dir, dtype):
    numel = sum(t.numel() for t in load_file(tiny_llama_dir / "model.safetensors").values())
    assert estimate_weight_bytes(tiny_llama_dir, dtype) == numel * dtype.itemsize


def _write_generation_config(folder, fields):
    folder.mkdir(exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(fields))
    return folder


def test_sampling_defaults_take_the_files_five_sampling_fields(tmp_path):
    # Qwen2.5's generation_config.json, plus fields that are not sampling defaults.
    model = _write_generation_config(tmp_path / "model", {
        "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
        "min_p": None, "max_new_tokens": 2048, "eos_token_id": [1, 2], "bos_token_id": 0})
    assert sampling_defaults("auto", model) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                                "repetition_penalty": 1.05}
    assert sampling_defaults("vllm", model) == {}
    other = _write_generation_config(tmp_path / "other", {"min_p": 0.05, "top_k": 1})
    assert sampling_defaults(str(other), model) == {"min_p": 0.05, "top_k": 1}


def test_sampling_defaults_without_a_file(tmp_path):
    assert sampling_defaults("auto", tmp_path) == {}
    with pytest.raises(ValueError, match="holds no generation_config.json"):
        sampling_defaults(str(tmp_path), tmp_path)
