"""tandem.bench.checkpoint: ``--model`` names and the safetensors folder that the HF modes and vLLM
get for a GGUF file. The oracle of the folder is tandem's own GGUF loader: transformers reading
the saved folder must give the greedy tokens tandem gives on the file, in float32."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import AutoModelForCausalLM

from tandem import LLM, SamplingParams
from tandem.bench.checkpoint import hf_folder, model_path
from tandem.cli import main
from tests.helpers.gguf_files import write_tiny_gguf

PROMPT = [1, 17, 33, 250, 9, 120]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "llama.gguf", "llama", lambda name, i: Q.Q8_0)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "tandem-cache"))


def test_a_gguf_file_becomes_a_folder_transformers_reads_with_tandems_greedy_tokens(tiny_gguf):
    folder = Path(hf_folder(str(tiny_gguf)))
    assert (folder / "config.json").is_file() and list(folder.glob("*.safetensors"))
    assert (folder / "tokenizer_config.json").is_file()
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    want = hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False)[0, len(PROMPT):].tolist()
    llm = LLM(model=str(tiny_gguf), dtype="float32", max_num_seqs=2)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == want


@pytest.mark.parametrize("kind", ["llama", "gemma3"])  # untied and tied embeddings
def test_the_folder_holds_every_tensor_by_its_checkpoint_name(kind, tmp_path):
    """Readers that do not tie on their own (vLLM's) need the input embedding under its own name:
    every parameter of the class built from the saved config is in the file, except a tied output
    embedding, with transformers' values for the GGUF file."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    path = write_tiny_gguf(tmp_path / f"{kind}.gguf", kind, lambda name, i: Q.Q8_0)
    folder = Path(hf_folder(str(path)))
    tensors = load_file(folder / "model.safetensors")
    config = AutoConfig.from_pretrained(folder)
    shape_only = AutoModelForCausalLM.from_config(config)
    expected = {name for name, _ in shape_only.named_parameters(remove_duplicate=False)}
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    assert set(tensors) == expected
    original = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    for name, value in original.state_dict().items():
        if name in tensors:
            assert torch.equal(tensors[name], value), name


def test_the_folder_is_built_once_and_a_folder_is_its_own(tiny_gguf):
    first = Path(hf_folder(str(tiny_gguf)))
    stamp = {p.name: p.stat().st_mtime_ns for p in first.iterdir()}
    assert Path(hf_folder(str(tiny_gguf))) == first
    assert {p.name: p.stat().st_mtime_ns for p in first.iterdir()} == stamp
    assert hf_folder(str(first)) == str(first)


def test_model_names_resolve_to_paths(tmp_path):
    assert model_path(str(tmp_path)) == str(tmp_path)
    assert (Path(model_path("demo")) / "config.json").is_file()
    smollm2 = Path(model_path("smollm2-135m-instruct"))
    assert smollm2.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and smollm2.is_file()


def test_bench_offline_runs_a_gguf_file_against_transformers(tiny_gguf, capsys):
    assert main(["bench", "offline", "--model", str(tiny_gguf), "--modes", "tandem", "hf-sequential",
                 "--num-requests", "3", "--prompt-len", "4", "8", "--output-len", "4", "6",
                 "--no-roofline"]) == 0
    out = capsys.readouterr().out
    row = re.search(r"^hf-sequential\s+[\d.]+\s+[\d.]+x\s+(\d+)%", out, re.MULTILINE)
    assert row is not None, out
    assert int(row.group(1)) == 100  # float32 on both sides: the same greedy tokens
