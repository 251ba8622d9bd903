"""Hostile input through the router of a disaggregated setup (issue 11, points 7 and 8): the same
schemathesis run as tests/server/test_fuzz.py, fed the instance's /openapi.json (the router has no
schema of its own for the bodies) and aimed at the router, in front of a prefill and a decode
``tandem serve`` subprocess handing KV over NIXL/UCX on 127.0.0.1.

The router's own /admin routes are fuzzed with the rest (without the admin key: they must stay
shut), and then each instance's /kv routes for KV_FUZZ_SECONDS with the cluster secret.

Must hold: no answer ≥ 500 and none missing at the router or the instances' /kv routes, the
router's instances unchanged, /health 200 at every poll of the router
and of both instances, both instances still in the router's rotation, no ``engine_exception``
counted by either, no KV block held or pinned once idle (a prefill whose decode was refused frees
its blocks at kv_expiry_s), and a greedy control request through the router answering, after the
fuzzing as before it, what the offline ``tandem.LLM`` answers on the same checkpoint.
"""
from __future__ import annotations

import httpx
import pytest

from tandem import LLM, SamplingParams
from tests.helpers.schema_fuzz import HealthWatch, fuzz, fuzz_seconds, fuzz_seed, only_paths
from tests.router.instances import (
    ADMIN,
    CLUSTER_SECRET,
    MODEL_NAME,
    PAIR_EXPIRY_S,
    dispatched,
    router_instance,
    running_router,
    scrape,
    wait_for,
)
from tests.server.server_helpers import ENGINE

pytest.importorskip("nixl_cu12", reason="the nixl KV connector needs nixl-cu12")
pytestmark = pytest.mark.slow

EXPIRY_S = PAIR_EXPIRY_S
CONTROL_PROMPT = "Through the router and back, the fuzzer's traffic"
CONTROL_TOKENS = 16
ENGINE_FAILURES = "tandem:request_errors_total{reason=engine_exception}"
MIN_REQUESTS = 100
KV_FUZZ_SECONDS = 5
KV_HEADER = "X-Tandem-KV-Secret"


@pytest.fixture(scope="module")
def setup(nixl_pair):
    prefill, decode = nixl_pair
    with running_router([(prefill.url, "prefill"), (decode.url, "decode")], health_interval_s=0.5) as router:
        assert wait_for(lambda: all(router_instance(router.url, i.url)["healthy"] for i in (prefill, decode)))
        yield prefill, decode, router


def control_text(router_url: str) -> str:
    body = {"model": MODEL_NAME, "prompt": CONTROL_PROMPT, "max_tokens": CONTROL_TOKENS, "temperature": 0}
    response = httpx.post(f"{router_url}/v1/completions", json=body, timeout=60)
    if response.status_code != 200:
        return f"<{response.status_code}: {response.text}>"
    return response.json()["choices"][0]["text"]


def idle_and_empty(url: str) -> bool:
    metrics = scrape(url)
    return all(metrics[name] == 0 for name in ("tandem:kv_blocks_used", "tandem:kv_blocks_pending_release",
                                               "tandem:num_requests_running", "tandem:num_requests_waiting"))


@pytest.mark.timeout(fuzz_seconds() + 300)
def test_schema_fuzzing_through_the_router_gets_no_5xx_and_leaves_both_instances_as_they_were(
        setup, model_dir, capsys):
    prefill, decode, router = setup
    oracle = LLM(model=str(model_dir), **ENGINE).generate(
        CONTROL_PROMPT, SamplingParams(temperature=0, max_tokens=CONTROL_TOKENS))
    want = oracle[0].outputs[0].text
    before = dispatched(router.url, "disaggregated")
    assert control_text(router.url) == want
    assert dispatched(router.url, "disaggregated") == before + 1  # through the prefill instance

    schema = httpx.get(f"{decode.url}/openapi.json", timeout=30).json()
    router_schema = httpx.get(f"{router.url}/openapi.json", timeout=30).json()
    schema["paths"].update(only_paths(router_schema, "/admin")["paths"])  # fuzzed without the admin key
    schema.setdefault("components", {}).setdefault("schemas", {}).update(
        router_schema.get("components", {}).get("schemas", {}))
    with HealthWatch([router.url, prefill.url, decode.url]) as watch:
        report = fuzz(schema, router.url, fuzz_seconds(), fuzz_seed(), watch)
        # the instances' /kv routes, with the cluster secret (what a peer holding it can send)
        kv_schema = only_paths(schema, "/kv/")
        kv_reports = [fuzz(kv_schema, url, KV_FUZZ_SECONDS, fuzz_seed(), watch, headers={KV_HEADER: CLUSTER_SECRET})
                      for url in (prefill.url, decode.url)]
    paths = {p: dispatched(router.url, p) for p in ("disaggregated", "direct", "local_prefill", "short_prompt")}
    with capsys.disabled():
        print(f"\n{report.summary('the router of a prefill and a decode instance')}; routed: {paths}; "
              f"/health polls: {watch.polls}, failed: {len(watch.failures)}")
        for name, kv_report in zip(("prefill", "decode"), kv_reports):
            print(kv_report.summary(f"the {name} instance's /kv routes"))

    problems = []
    if report.requests < MIN_REQUESTS:
        problems.append(f"only {report.requests} requests were fuzzed: {report.fatal}")
    for each in (report, *kv_reports):
        if each.server_errors:
            problems.append(f"{len(each.server_errors)} answers ≥ 500 or missing, by cause:\n"
                            f"{each.distinct_errors()}")
    if any(r.requests == 0 for r in kv_reports):
        problems.append(f"the /kv routes were not fuzzed: {[r.fatal for r in kv_reports]}")
    listed = httpx.get(f"{router.url}/admin/instances", headers=ADMIN, timeout=10).json()["instances"]
    if sorted(i["url"] for i in listed) != sorted([prefill.url, decode.url]):
        problems.append(f"the fuzzer changed the router's instances (its admin API needs a key): {listed}")
    if watch.failures:
        problems.append(f"/health failed {len(watch.failures)} times, first: {watch.failures[:3]}")
    for name, proc in (("prefill", prefill), ("decode", decode)):
        if proc.proc.poll() is not None:
            problems.append(f"the {name} instance exited with {proc.proc.returncode}")
            continue
        if not router_instance(router.url, proc.url)["healthy"]:
            problems.append(f"the {name} instance left rotation: {router_instance(router.url, proc.url)['reason']}")
        if not wait_for(lambda: idle_and_empty(proc.url), EXPIRY_S + 15):
            problems.append(f"the {name} instance still holds KV blocks or requests: "
                            f"{ {k: v for k, v in scrape(proc.url).items() if 'kv_blocks' in k or 'num_req' in k} }")
        if scrape(proc.url).get(ENGINE_FAILURES, 0) != 0:
            problems.append(f"the {name} instance counted {ENGINE_FAILURES} = {scrape(proc.url)[ENGINE_FAILURES]}")
    alive = all(p.proc.poll() is None for p in (prefill, decode))
    if alive and (after := control_text(router.url)) != want:
        problems.append(f"the greedy control text changed: {after!r} instead of {want!r}")
    assert not problems, "\n".join(problems)
