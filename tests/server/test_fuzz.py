"""Hostile input from a schema fuzzer (issue 11, point 8): schemathesis's coverage and fuzzing
phases, from the instance's own /openapi.json, against a ``tandem serve`` subprocess of the tiny
Llama for TANDEM_FUZZ_SECONDS (20 by default), with the ``not_a_server_error`` check.

The instance is a subprocess so that whatever a request does to it (an engine that dies, a
process that exits) is seen from outside, as a client sees it. Must hold: no answer ≥ 500 and
none missing, /health 200 at every poll meanwhile, no ``engine_exception`` counted, no KV block
held once idle, and a greedy control request answering, after the fuzzing as before it, what the
offline ``tandem.LLM`` answers on the same checkpoint (the oracle). The figures are printed.
"""
from __future__ import annotations

import httpx
import pytest

from tandem import SamplingParams
from tests.helpers.schema_fuzz import HealthWatch, fuzz, fuzz_seconds, fuzz_seed
from tests.router.instances import MODEL_NAME, InstanceProcess, scrape, wait_for

pytestmark = pytest.mark.slow

CONTROL_PROMPT = "The fuzzer came and went, and the answer"
CONTROL_TOKENS = 16
ENGINE_FAILURES = 'tandem:request_errors_total{reason=engine_exception}'
MIN_REQUESTS = 100
"""Fewer requests than this in the whole run means the fuzzer did not really run."""


@pytest.fixture(scope="module")
def instance(model_dir, tmp_path_factory):
    proc = InstanceProcess(model_dir, tmp_path_factory.mktemp("fuzz-instance")).start()
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def control_text(url: str) -> str:
    """The greedy control answer's text, or what came instead of a 200."""
    body = {"model": MODEL_NAME, "prompt": CONTROL_PROMPT, "max_tokens": CONTROL_TOKENS, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    if response.status_code != 200:
        return f"<{response.status_code}: {response.text}>"
    return response.json()["choices"][0]["text"]


def idle_and_empty(url: str) -> bool:
    metrics = scrape(url)
    return (metrics["tandem:kv_blocks_used"], metrics["tandem:num_requests_running"],
            metrics["tandem:num_requests_waiting"]) == (0, 0, 0)


@pytest.mark.timeout(fuzz_seconds() + 300)
def test_schema_fuzzing_gets_no_5xx_and_leaves_the_instance_as_it_was(instance, offline, capsys):
    oracle = offline.generate(CONTROL_PROMPT, SamplingParams(temperature=0, max_tokens=CONTROL_TOKENS))
    want = oracle[0].outputs[0].text
    assert control_text(instance.url) == want

    schema = httpx.get(f"{instance.url}/openapi.json", timeout=30).json()
    with HealthWatch([instance.url]) as watch:
        report = fuzz(schema, instance.url, fuzz_seconds(), fuzz_seed(), watch)
    with capsys.disabled():
        print(f"\n{report.summary('a tandem instance')}; /health polls: {watch.polls}, "
              f"failed: {len(watch.failures)}")

    problems = []
    if report.requests < MIN_REQUESTS:
        problems.append(f"only {report.requests} requests were fuzzed: {report.fatal}")
    if report.server_errors:
        problems.append(f"{len(report.server_errors)} answers ≥ 500 or missing, by cause:\n"
                        f"{report.distinct_errors()}")
    if watch.failures:
        problems.append(f"/health failed {len(watch.failures)} times, first: {watch.failures[:3]}")
    if instance.proc.poll() is not None:
        problems.append(f"the instance exited with {instance.proc.returncode}")
    else:
        if not wait_for(lambda: idle_and_empty(instance.url), 15):
            problems.append(f"not idle with every KV block free 15 s after the fuzzing: "
                            f"{ {k: v for k, v in scrape(instance.url).items() if 'kv_blocks' in k or 'num_req' in k} }")
        if scrape(instance.url).get(ENGINE_FAILURES, 0) != 0:
            problems.append(f"{ENGINE_FAILURES} = {scrape(instance.url)[ENGINE_FAILURES]}")
        if (after := control_text(instance.url)) != want:
            problems.append(f"the greedy control text changed: {after!r} instead of {want!r}")
    assert not problems, "\n".join(problems)
