"""A worker that dies or hangs never hangs the instance's clients: the engine raises
``EngineDeadError`` within ``engine.worker_timeout_s`` (a killed local rank at once, through its
process sentinel), the remaining ranks are stopped, and ``tandem serve -tp 2`` — whose greedy
text equals the single-process engine's, the oracle — exits non-zero."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tandem import LLM, SamplingParams
from tandem.errors import EngineDeadError
from tests.helpers.tiny_models import tiny_model_dir
from tests.router.instances import free_port, wait_healthy

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8)


def _tp2(timeout_s: float) -> LLM:
    return LLM(model=str(tiny_model_dir("llama")), num_kv_blocks=64, tensor_parallel_size=2,
               worker_timeout_s=timeout_s)


@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_a_dead_or_hung_rank_fails_the_engine_within_the_timeout(how):
    timeout_s = 6.0
    llm = _tp2(timeout_s)
    executor = llm.engine.executor
    try:
        assert llm.generate([[5, 6, 7]], GREEDY)[0].outputs[0].finish_reason == "length"
        rank1 = executor.procs[1]
        os.kill(rank1.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        t0 = time.monotonic()
        # a killed rank is named as the cause, even when rank 0's collective fails first
        cause = "died during a step: .*pid %d" % rank1.pid if how == "killed" else "did not finish|collective"
        with pytest.raises(EngineDeadError, match=cause):
            llm.generate([[5, 6, 7, 8]], GREEDY)
        elapsed = time.monotonic() - t0
        assert elapsed < timeout_s + 5, elapsed
        if how == "killed":
            assert elapsed < timeout_s, elapsed  # the sentinel fires before the timeout
        deadline = time.monotonic() + 10
        while any(p.is_alive() for p in executor.procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(p.is_alive() for p in executor.procs), "the other ranks were left running"
    finally:
        llm.engine.close()


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_serve_tp2_answers_like_one_process_and_exits_nonzero_when_a_worker_dies():
    path = tiny_model_dir("llama")
    prompt = [11, 12, 13, 14, 15]
    want = LLM(model=str(path), num_kv_blocks=64).generate([prompt], GREEDY)[0].outputs[0].text
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tandem", "serve", str(path), "--port", str(port),
                             "-tp", "2", "--num-kv-blocks", "64", "--worker-timeout-s", "20"],
                            cwd=REPO, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, lambda: None if proc.poll() is None else proc.stderr.read(), 120, "tandem serve -tp 2")
        body = {"model": str(path), "prompt": prompt, "max_tokens": 8,
                "min_tokens": 8, "temperature": 0}
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == want

        workers = [p for p in _children(proc.pid)
                   if "tandem.executor" in Path(f"/proc/{p}/cmdline").read_text(errors="replace")]
        assert workers, "no worker process found"
        os.kill(workers[-1], signal.SIGKILL)
        t0 = time.monotonic()  # idle: no request has to come for the server to notice
        code = proc.wait(timeout=30)
        assert code != 0
        assert time.monotonic() - t0 < 10
        assert "engine failed" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
