"""Ranks start as tandem's own processes (``python -m tandem.executor``), never by re-importing the
user's main module: a script read from stdin (``python -`` with a heredoc), a script file without
an ``if __name__ == "__main__":`` guard (its body runs once, not once per rank) and ``python -c``
each run ``LLM(..., tensor_parallel_size=2)``, and their greedy tokens equal the one-process
engine's (the oracle)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tandem import LLM, SamplingParams
from tests.helpers.tiny_models import tiny_model_dir

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 6, 7, 8], [11, 12, 13]]
SCRIPT = """\
import json
import sys

from tandem import LLM, SamplingParams

model, log = sys.argv[1], sys.argv[2]
with open(log, "a") as f:
    f.write("the body ran\\n")
llm = LLM(model=model, num_kv_blocks=64, tensor_parallel_size=2, worker_timeout_s=120)
outputs = llm.generate(%r, SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8))
print(json.dumps([o.outputs[0].token_ids for o in outputs]))
""" % (PROMPTS,)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def one_process_tokens(model_dir) -> list[list[int]]:
    llm = LLM(model=str(model_dir), num_kv_blocks=64)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8))
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("how", ["stdin", "unguarded file", "-c"])
def test_a_tp2_script_runs_its_body_once_and_answers_like_one_process(how, model_dir, one_process_tokens,
                                                                       tmp_path):
    log = tmp_path / "body.log"
    args = [str(model_dir), str(log)]
    if how == "stdin":
        argv, stdin = [sys.executable, "-", *args], SCRIPT
    elif how == "unguarded file":
        script = tmp_path / "unguarded.py"
        script.write_text(SCRIPT)
        argv, stdin = [sys.executable, str(script), *args], None
    else:
        argv, stdin = [sys.executable, "-c", SCRIPT, *args], None
    done = subprocess.run(argv, input=stdin, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert log.read_text().splitlines() == ["the body ran"]
    assert json.loads(done.stdout.splitlines()[-1]) == one_process_tokens


def test_a_rank_is_started_with_no_more_than_its_rank_in_argv(model_dir, one_process_tokens):
    """The cluster key and the configuration travel on the rank's stdin: ``ps`` shows neither."""
    llm = LLM(model=str(model_dir), num_kv_blocks=64, tensor_parallel_size=2, worker_timeout_s=120)
    try:
        procs = llm.engine.executor.procs
        argvs = [Path(f"/proc/{p.pid}/cmdline").read_bytes().split(b"\0")[:-1] for p in procs]
        head = [sys.executable.encode(), b"-m", b"tandem.executor", b"--rank"]
        assert argvs[0][:5] == [*head, b"0"] and argvs[0][5] == b"--conn-fd" and len(argvs[0]) == 7, argvs[0]
        assert argvs[1] == [*head, b"1"], argvs[1]
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8))
        assert [o.outputs[0].token_ids for o in outputs] == one_process_tokens
    finally:
        llm.engine.close()
