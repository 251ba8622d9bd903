"""GGUF files of tiny random models (written with gguf's own writer, tests.helpers.gguf_files)
served by ``LLM(model="x.gguf")`` with no other file: config from the metadata, weights
dequantized from every ggml type tandem accepts, tokenizer from the metadata. The oracle is
transformers loading the same file (``from_pretrained(folder, gguf_file=name)``), float32,
greedy by plain argmax."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from transformers import AutoConfig, AutoModelForCausalLM

from tandem import LLM, SamplingParams
from tandem.models.config import ModelArchConfig
from tandem.models.gguf_file import read_gguf
from tests.helpers.gguf_files import ALL_TYPES, write_tiny_gguf

# Early tokens differ between the first two: the outputs must differ too (the model reads them).
PROMPTS = [[5, 100, 200, 300, 17, 42, 99, 7, 8, 9, 11], [6, 100, 200, 300, 17, 42, 99, 7, 8, 9, 11], [1, 2, 3]]
NEW_TOKENS = 10
# llama: every type once or more, round robin over its 16 matrices; the others a few types each
TYPES = {
    "llama": lambda name, i: ALL_TYPES[i % len(ALL_TYPES)],
    "mistral": lambda name, i: (Q.Q8_0, Q.Q4_K, Q.F16)[i % 3],
    "qwen2": lambda name, i: (Q.Q5_1, Q.Q6_K, Q.BF16)[i % 3],
    "qwen3": lambda name, i: (Q.Q4_0, Q.Q3_K, Q.F32)[i % 3],
    "gemma3": lambda name, i: (Q.Q5_0, Q.Q2_K, Q.Q5_K, Q.Q4_1)[i % 4],
}


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    for kind, types in TYPES.items():
        write_tiny_gguf(root / f"{kind}.gguf", kind, types)
    return root


def _hf_greedy(model, prompt: list[int]) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_the_llama_file_holds_every_type(gguf_dir):
    assert {t.tensor_type for t in read_gguf(gguf_dir / "llama.gguf").tensors} == set(ALL_TYPES)


@pytest.mark.parametrize("kind", list(TYPES))
def test_greedy_tokens_match_transformers_on_the_same_file(gguf_dir, kind):
    path = gguf_dir / f"{kind}.gguf"
    hf = AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=path.name, dtype=torch.float32).eval()
    want = [_hf_greedy(hf, p) for p in PROMPTS]
    llm = LLM(model=str(path), num_kv_blocks=32, dtype="float32", num_threads=1)
    got = [o.outputs[0].token_ids for o in llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))]
    assert got == want
    assert want[0] != want[1]


@pytest.mark.parametrize("kind", list(TYPES))
def test_architecture_from_the_metadata_matches_transformers(gguf_dir, kind):
    ours = ModelArchConfig.from_pretrained_dir(gguf_dir / f"{kind}.gguf")
    hf = AutoConfig.from_pretrained(str(gguf_dir), gguf_file=f"{kind}.gguf")
    fields = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "vocab_size", "rms_norm_eps", "max_position_embeddings",
              "tie_word_embeddings")
    assert {f: getattr(ours, f) for f in fields} == pytest.approx({f: getattr(hf, f) for f in fields})
    assert ours.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    assert ours.rope_theta == pytest.approx(hf.rope_parameters.get("full_attention", hf.rope_parameters)["rope_theta"])
    assert ours.model_type == hf.model_type
    if kind == "gemma3":
        assert ours.layer_types == tuple(hf.layer_types) and ours.sliding_window == hf.sliding_window
        assert ours.sliding_rope == (hf.rope_parameters["sliding_attention"]["rope_theta"], None)


def test_an_unsupported_architecture_is_refused_by_name(tmp_path):
    path = tmp_path / "phi2.gguf"
    writer = GGUFWriter(str(path), "phi2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"'phi2' is not supported; supported: llama, mistral, qwen2, qwen3, gemma3"):
        LLM(model=str(path), num_kv_blocks=16)


def test_a_file_that_is_not_gguf_is_refused_by_name(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match=r"broken.gguf is not a GGUF file"):
        LLM(model=str(path), num_kv_blocks=16)
