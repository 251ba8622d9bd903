"""lm-evaluation-harness through tandem's server: lm-eval's ``local-completions`` model against a
real uvicorn serving SmolLM2-135M-Instruct (the registry's GGUF file, float32), and lm-eval's own
transformers backend (``hf``, given transformers' float32 load of the same file, the process's one
oracle from tests.helpers.trained) as the oracle. The task is built here (lm_eval_tasks/: sixteen
hand-written questions, no download), run twice: as multiple choice, scored from the prompt
logprobs /v1/completions echoes, and as greedy generation. Each item must get the same answer from
both."""
from __future__ import annotations

import math
from pathlib import Path

import httpx
import pytest

from tests.helpers.trained import hf_model, hf_tokenizer, smollm2_path
from tests.server.server_helpers import running_server, server_config

TASK_DIR = Path(__file__).parent / "lm_eval_tasks"
REPO_ROOT = Path(__file__).parents[2]
"""The tasks' data_files are relative to the repository root, where the docs run lm_eval."""
MC, GEN = "tandem_facts_mc", "tandem_facts_gen"
BATCH = 16
LOGPROB_ATOL = 1e-3


def _evaluate(model, model_args: dict | None = None) -> dict[str, list[dict]]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[MC, GEN],
                                  task_manager=TaskManager(include_path=str(TASK_DIR), include_defaults=False),
                                  log_samples=True, bootstrap_iters=0)
    return {task: sorted(samples, key=lambda s: s["doc_id"]) for task, samples in out["samples"].items()}


@pytest.fixture(scope="module")
def samples(tmp_path_factory) -> tuple[dict, dict]:
    """lm-eval's logged samples of both tasks: (through tandem, through lm-eval's hf backend)."""
    from lm_eval.models.huggingface import HFLM

    path = smollm2_path()
    tokenizer_dir = tmp_path_factory.mktemp("tokenizer")
    hf_tokenizer().save_pretrained(tokenizer_dir)  # what local-completions counts tokens with
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO_ROOT)
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        with running_server(server_config(path, **{"model.dtype": "float32"})) as server:
            served = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
            tandem = _evaluate("local-completions", {
                "model": served, "base_url": f"{server.url}/v1/completions", "tokenizer": str(tokenizer_dir),
                "tokenizer_backend": "huggingface", "batch_size": BATCH})
        hf = _evaluate(HFLM(pretrained=hf_model(), tokenizer=hf_tokenizer(), batch_size=BATCH))
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
