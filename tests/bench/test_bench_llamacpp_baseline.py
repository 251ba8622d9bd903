"""`tandem bench offline --baseline llamacpp`: a baseline that cannot run is a usage error naming
the flag before anything loads; and, where scripts/make_llamacpp_venv.sh has built .venv-llamacpp
(CI does not: a build takes minutes), llama.cpp's driver gives transformers' greedy tokens on the
same GGUF file, and the whole benchmark runs and prints both comparisons."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.bench.peers import llamacpp_driver as driver
from tandem.bench.peers.llamacpp_offline import DECODE_PROMPT_TOKENS, PP_TOKENS, batch1_prompts
from tandem.bench.workload import Workload
from tandem.cli import main
from tests.helpers.tiny_models import tiny_model_dir

LLAMACPP_PYTHON = Path(os.environ.get("TANDEM_LLAMACPP_PYTHON")
                       or Path(__file__).resolve().parents[2] / ".venv-llamacpp" / "bin" / "python")



def _has_llama_cpp() -> bool:
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('llama_cpp') is None)"
    return LLAMACPP_PYTHON.exists() and subprocess.run([str(LLAMACPP_PYTHON), "-c", probe],
                                                       capture_output=True, timeout=60).returncode == 0


needs_llamacpp = pytest.mark.skipif(not _has_llama_cpp(),
                                    reason=f"no llama-cpp-python venv at {LLAMACPP_PYTHON} "
                                           "(scripts/make_llamacpp_venv.sh builds one)")


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    from gguf import GGMLQuantizationType as Q

    from tests.helpers.gguf_files import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "llama.gguf", "llama", lambda name, i: Q.F32)


def test_baseline_without_its_python_names_the_flag(capsys):
    assert main(["bench", "offline", "--model", "/nonexistent.gguf", "--baseline", "llamacpp"]) == 2
    assert "--baseline llamacpp needs --llamacpp-python PATH" in capsys.readouterr().err


def test_a_model_that_is_not_a_gguf_file_is_refused(capsys):
    model = str(tiny_model_dir("llama"))
    assert main(["bench", "offline", "--model", model, "--baseline", "llamacpp",
                 "--llamacpp-python", sys.executable]) == 2
    assert f"--model {model} is not one" in capsys.readouterr().err


def test_a_python_without_llama_cpp_names_the_flag(gguf_file, capsys):
    if importlib.util.find_spec("llama_cpp") is not None:
        pytest.skip("this python has llama_cpp")
    assert main(["bench", "offline", "--model", str(gguf_file), "--baseline", "llamacpp",
                 "--llamacpp-python", sys.executable]) == 2
    assert f"--llamacpp-python {sys.executable}: that python has no llama_cpp" in capsys.readouterr().err


def test_batch1_prompts_come_from_the_workload():
    wl = Workload(prompts=[[1, 2, 3], [4, 5]], max_tokens=[1, 1])
    pp, decode = batch1_prompts(wl)
    assert len(pp) == PP_TOKENS and pp[:7] == [1, 2, 3, 4, 5, 1, 2]
    assert decode == pp[-DECODE_PROMPT_TOKENS:]


def test_the_driver_rejects_a_workload_missing_a_key(tmp_path):
    path = tmp_path / "workload.json"
    path.write_text(json.dumps({"model": "m", "prompts": [[1]], "max_tokens": [1]}))
    with pytest.raises(ValueError, match="threads, n_ctx, pp_prompt, decode_prompt, decode_tokens, repeats"):
        driver.load_workload(str(path))


@needs_llamacpp
@pytest.mark.timeout(300)
def test_the_driver_gives_transformers_greedy_tokens_on_the_same_file(gguf_file, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    prompts, max_tokens = [[5, 9, 14, 3, 22], [7] * 12 + [30, 31]], [6, 4]
    workload = {"model": str(gguf_file), "threads": 1, "n_ctx": 64, "prompts": prompts, "max_tokens": max_tokens,
                "pp_prompt": [], "decode_prompt": [5, 9], "decode_tokens": 4, "repeats": 0}
    (tmp_path / "w.json").write_text(json.dumps(workload))
    subprocess.run([str(LLAMACPP_PYTHON), driver.__file__, str(tmp_path / "w.json"), str(tmp_path / "r.json")],
                   check=True, timeout=240)
    result = json.loads((tmp_path / "r.json").read_text())
    hf = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    for prompt, m, got in zip(prompts, max_tokens, result["outputs"]):
        ids = torch.tensor([prompt])
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=m, min_new_tokens=m,
                           do_sample=False)[0, len(prompt):].tolist()
        assert got == want


@needs_llamacpp
@pytest.mark.timeout(300)
def test_the_benchmark_prints_both_comparisons(gguf_file, capsys):
    assert main(["bench", "offline", "--model", str(gguf_file), "--baseline", "llamacpp", "--llamacpp-python",
                 str(LLAMACPP_PYTHON), "--modes", "tandem", "--num-requests", "3", "--prompt-len", "4", "8",
                 "--output-len", "3", "5", "--dtype", "float32", "--no-roofline"]) == 0
    out = capsys.readouterr().out
    assert "the requests ran one after another" in out
    assert "tandem / llamacpp:" in out and "greedy agreement 100.0% of output tokens" in out
    assert "prompt processing tok/s" in out and "decode tok/s" in out
