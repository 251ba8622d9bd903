"""A frozen prefill instance over UCX's TCP transport (``UCX_TLS=tcp``), between real processes:
the decode instance's read passes its deadline, and when the prefill instance resumes, UCX still
delivers that read (TCP cannot take back a request already sent). Those blocks stay quarantined
until the read is over, so the requests running on the decode instance meanwhile — in the blocks
the pool hands out next — answer exactly as a colocated instance does (the oracle)."""
from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest

from tests.engine.test_greedy_vs_hf import _prompts
from tests.router.instances import KV_SECRET, InstanceProcess, role_env, scrape, wait_for
from tests.router.test_disaggregated_flow import BLOCK, _hand_over, body

pytest.importorskip("nixl_cu12", reason="the nixl KV connector needs nixl-cu12")

TIMEOUT_S = 1.0


def _texts(url: str, prompts: list[list[int]]) -> list[str]:
    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            answers = await asyncio.gather(*(client.post("/v1/completions", json=body(p, max_tokens=16))
                                             for p in prompts))
        assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
        return [a.json()["choices"][0]["text"] for a in answers]

    return asyncio.run(run())


@pytest.mark.timeout(300)
def test_a_resumed_prefill_instance_writes_only_into_quarantined_blocks(model_dir, log_dir, colocated):
    tcp = {"UCX_TLS": "tcp"}
    prefill = InstanceProcess(model_dir, log_dir, **role_env("prefill", 60.0, **tcp)).start()
    decode = InstanceProcess(model_dir, log_dir, **role_env(
        "decode", 60.0, TANDEM_DISAGGREGATION__KV_TRANSFER_TIMEOUT_S=str(TIMEOUT_S),
        TANDEM_DISAGGREGATION__KV_LOAD_FAILURE_POLICY="fail", **tcp)).start()
    try:
        for proc in (prefill, decode):
            proc.wait_ready()
        frozen_prompt, *others = _prompts(61, [10 * BLOCK + 3, 3 * BLOCK, 5 * BLOCK + 1, 2 * BLOCK, 4 * BLOCK])
        want = _texts(colocated.url, others)
        warm = _hand_over(prefill.url, _prompts(62, [BLOCK + 1])[0])  # the decode side meets its peer
        assert httpx.post(f"{decode.url}/v1/completions", timeout=60, headers=KV_SECRET, json=body(
            _prompts(62, [BLOCK + 1])[0], kv_transfer_params=warm)).status_code == 200
        params = _hand_over(prefill.url, frozen_prompt)
        prefill.send_signal(signal.SIGSTOP)
        start = time.monotonic()
        failed = httpx.post(f"{decode.url}/v1/completions", timeout=60, headers=KV_SECRET,
                            json=body(frozen_prompt, kv_transfer_params=params))
        assert failed.status_code == 502 and failed.json()["error"]["code"] == "kv_transfer_failed"
        assert time.monotonic() - start >= TIMEOUT_S
        metrics = scrape(decode.url)
        assert metrics["tandem:kv_blocks_quarantined"] == 11  # prompt positions 0..161: 11 blocks
        assert metrics["tandem:kv_transfer_failures_total{reason=deadline}"] == 1

        async def others_while_it_resumes():
            async with httpx.AsyncClient(base_url=decode.url, timeout=120) as client:
                jobs = [asyncio.ensure_future(client.post("/v1/completions", json=body(p, max_tokens=16)))
                        for p in others]
                await asyncio.sleep(0.3)
                prefill.send_signal(signal.SIGCONT)  # the late read lands while they decode
                answers = await asyncio.gather(*jobs)
            assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
            return [a.json()["choices"][0]["text"] for a in answers]

        assert asyncio.run(others_while_it_resumes()) == want
        assert wait_for(lambda: scrape(decode.url)["tandem:kv_blocks_quarantined"] == 0, 15)
        assert wait_for(lambda: scrape(decode.url)["tandem:kv_blocks_used"] == 0, 15)
        assert _texts(decode.url, others) == want  # and nothing stale entered the prefix cache
    finally:
        prefill.send_signal(signal.SIGCONT)
        for proc in (prefill, decode):
            proc.stop()
