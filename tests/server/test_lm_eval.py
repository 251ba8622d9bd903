"""lm-evaluation-harness through tandem's server: lm-eval's ``local-completions`` model against a
real uvicorn serving SmolLM2-135M-Instruct (the registry's GGUF file, float32), and lm-eval's own
transformers backend (``hf`` loading the same file, float32) as the oracle. The task is built
here (lm_eval_tasks/: sixteen hand-written questions, no download), run twice: as multiple
choice, scored from the prompt logprobs /v1/completions echoes, and as greedy generation. Each
item must get the same answer from both. transformers' float32 load of the GGUF is saved once per
machine (cache_dir()/lm_eval) as a plain folder both backends read: the oracle's weights and the
tokenizer local-completions needs, without converting the file twice per run."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.models.presets import cache_dir
from tests.helpers.gguf_files import registry_gguf
from tests.server.server_helpers import running_server, server_config

TASK_DIR = Path(__file__).parent / "lm_eval_tasks"
REPO_ROOT = Path(__file__).parents[2]
"""The tasks' data_files are relative to the repository root, where the docs run lm_eval."""
MC, GEN = "tandem_facts_mc", "tandem_facts_gen"
BATCH = 16
LOGPROB_ATOL = 1e-3


def _evaluate(model: str, model_args: dict) -> dict[str, list[dict]]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[MC, GEN],
                                  task_manager=TaskManager(include_path=str(TASK_DIR)),
                                  log_samples=True, bootstrap_iters=0)
    return {task: sorted(samples, key=lambda s: s["doc_id"]) for task, samples in out["samples"].items()}


def _hf_folder(gguf: Path) -> Path:
    """transformers' float32 model and tokenizer of ``gguf``, saved once (keyed by its size)."""
    folder = cache_dir() / "lm_eval" / f"{gguf.stem}-{gguf.stat().st_size}-float32"
    if not (folder / "config.json").exists():
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(partial)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        # save_pretrained refuses a model loaded from GGUF: its dequantized weights and its
        # config without the gguf quantization entry make a plain float32 checkpoint
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        (partial / "config.json").write_text(json.dumps(config))
        save_model(model, str(partial / "model.safetensors"))
        partial.rename(folder)
    return folder


@pytest.fixture(scope="module")
def samples() -> tuple[dict, dict]:
    """lm-eval's logged samples of both tasks: (through tandem, through lm-eval's hf backend)."""
    path = registry_gguf("smollm2-135m-instruct")
    hf_folder = _hf_folder(path)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO_ROOT)
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        with running_server(server_config(path, **{"model.dtype": "float32"})) as server:
            served = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
            tandem = _evaluate("local-completions", {
                "model": served, "base_url": f"{server.url}/v1/completions", "tokenizer": str(hf_folder),
                "tokenizer_backend": "huggingface", "batch_size": BATCH})
        hf = _evaluate("hf", {"pretrained": str(hf_folder), "dtype": "float32", "device": "cpu",
                              "batch_size": BATCH})
    return tandem, hf


def test_multiple_choice_picks_the_same_choice_with_close_logprobs(samples):
    tandem, hf = samples
    assert [s["doc_id"] for s in tandem[MC]] == [s["doc_id"] for s in hf[MC]] == list(range(16))
    for ours, theirs in zip(tandem[MC], hf[MC]):
        ours_ll = [loglikelihood for loglikelihood, _ in ours["filtered_resps"]]
        theirs_ll = [loglikelihood for loglikelihood, _ in theirs["filtered_resps"]]
        assert len(ours_ll) == len(ours["doc"]["choices"]) == 4
        for a, b in zip(ours_ll, theirs_ll):
            assert math.isclose(a, b, abs_tol=LOGPROB_ATOL), (ours["doc"]["question"], ours_ll, theirs_ll)
        assert ours_ll.index(max(ours_ll)) == theirs_ll.index(max(theirs_ll)), ours["doc"]["question"]
        assert [greedy for _, greedy in ours["filtered_resps"]] == [greedy for _, greedy in theirs["filtered_resps"]]
        assert ours["acc"] == theirs["acc"]


def test_generated_answers_are_the_same_strings(samples):
    tandem, hf = samples
    ours = [s["resps"][0][0] for s in tandem[GEN]]
    theirs = [s["resps"][0][0] for s in hf[GEN]]
    assert ours == theirs
    # the answers depend on the question, so equal strings say something
    assert all(text.strip() for text in ours) and len(set(ours)) > len(ours) // 2, ours
