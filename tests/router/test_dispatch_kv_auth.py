"""The router's side of authenticated hand-overs and of given-up ones (issue 12), against the
recording stand-ins of tests/router/fakes.py: the cluster secret reaches instances exactly with
the requests that carry kv_transfer_params, and a hand-over that no decode instance took is
released on its prefill instance at once."""
from __future__ import annotations

import httpx
import pytest

from tests.router.fakes import completion, json_reply, sse_reply
from tests.router.instances import running_router, upstream
from tests.router.test_dispatch import CLIENT_BODY, DONE, FINISH, HAND_OVER, ROLE, TEXT, fakes, post

SECRET = "router-test-cluster-secret-42"
HEADER = b"x-tandem-kv-secret"
WITH_ID = {**HAND_OVER, "transfer_id": "prefill-0/cmpl-1-0"}


def secrets_sent(headers: list[tuple[bytes, bytes]]) -> list[bytes]:
    return [value for name, value in headers if name.lower() == HEADER]


def refusal(status: int, code: str = "invalid_request") -> dict:
    return {"error": {"message": "refused", "type": "invalid_request_error", "param": None, "code": code}}


@pytest.mark.timeout(60)
def test_the_secret_goes_with_every_step_that_carries_kv_transfer_params_only():
    stack, (prefill, decode) = fakes(json_reply(completion("x", kv_transfer_params=WITH_ID)),
                                     json_reply(completion("decoded")))
    instances = [(prefill.url, "prefill"), (decode.url, "decode")]
    client_headers = {"X-Tandem-KV-Secret": "a client's guess", "Authorization": "Bearer k"}
    with stack, running_router(instances, kv_transfer_secret=SECRET, api_key="k",
                               min_disaggregated_prompt_tokens=4) as router:
        answer = httpx.post(f"{router.url}/v1/completions", json=CLIENT_BODY, headers=client_headers, timeout=30)
        assert answer.status_code == 200
        assert secrets_sent(prefill.headers[0]) == [SECRET.encode()]
        assert secrets_sent(decode.headers[0]) == [SECRET.encode()]
        assert decode.bodies[0]["kv_transfer_params"]["do_remote_prefill"] is True
        short = {**CLIENT_BODY, "prompt": "tiny"}  # under min_disaggregated_prompt_tokens: direct
        assert httpx.post(f"{router.url}/v1/completions", json=short, headers=client_headers,
                          timeout=30).status_code == 200
        assert "kv_transfer_params" not in decode.bodies[1]
        assert secrets_sent(decode.headers[1]) == []  # no hand-over, no secret; the client's is dropped
        assert prefill.releases == []


@pytest.mark.timeout(60)
def test_without_a_secret_the_router_sends_none():
    stack, (prefill, decode) = fakes(json_reply(completion("x", kv_transfer_params=WITH_ID)),
                                     json_reply(completion("decoded")))
    with stack, running_router([(prefill.url, "prefill"), (decode.url, "decode")], kv_transfer_secret=None,
                               allow_insecure_no_secret=True) as router:  # the operator's explicit choice
        assert post(router, CLIENT_BODY).status_code == 200
        assert secrets_sent(prefill.headers[0]) == secrets_sent(decode.headers[0]) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("status", [400, 401, 404, 500, 502])
def test_a_hand_over_the_decode_instance_refused_is_released_on_the_prefill_instance(status):
    stack, (prefill, decode) = fakes(json_reply(completion("x", kv_transfer_params=WITH_ID)),
                                     json_reply(refusal(status), status=status))
    with stack, running_router([(prefill.url, "prefill"), (decode.url, "decode")],
                               kv_transfer_secret=SECRET) as router:
        answer = post(router, CLIENT_BODY)
        assert (answer.status_code, answer.json()) == (status, refusal(status))
        # released before the client got its answer
        assert [body for body, _ in prefill.releases] == [{"transfer_id": WITH_ID["transfer_id"]}]
        assert secrets_sent(prefill.releases[0][1]) == [SECRET.encode()]
        assert upstream(router.url, prefill.url, "release", "ok") == 1


@pytest.mark.timeout(60)
def test_a_hand_over_no_decode_instance_could_take_is_released():
    stack, (prefill, busy, closing) = fakes(json_reply(completion("x", kv_transfer_params=WITH_ID)),
                                            json_reply(refusal(429), status=429),
                                            json_reply(refusal(503), status=503))
    instances = [(prefill.url, "prefill"), (busy.url, "decode"), (closing.url, "decode")]
    with stack, running_router(instances, health_interval_s=60) as router:
        assert post(router, CLIENT_BODY).status_code == 429  # the last 429 relayed
        assert len(busy.bodies) == len(closing.bodies) == 1  # each was offered the hand-over
        assert [body for body, _ in prefill.releases] == [{"transfer_id": WITH_ID["transfer_id"]}]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("decode_reply, stream", [
    (json_reply(completion("decoded")), False),  # read: the decode instance notifies the prefill itself
    (json_reply(refusal(409, "kv_transfer_replayed"), status=409), False),  # the first user holds it
    (sse_reply([ROLE, *TEXT, FINISH, DONE]), True),
], ids=["200", "409", "stream"])
def test_a_hand_over_a_decode_instance_took_is_not_released(decode_reply, stream):
    stack, (prefill, decode) = fakes(json_reply(completion("x", kv_transfer_params=WITH_ID)), decode_reply)
    with stack, running_router([(prefill.url, "prefill"), (decode.url, "decode")]) as router:
        post(router, {**CLIENT_BODY, "stream": stream})
        assert decode.bodies[0]["kv_transfer_params"]["transfer_id"] == WITH_ID["transfer_id"]
        assert prefill.releases == []


@pytest.mark.timeout(60)
def test_a_hand_over_that_may_be_read_by_a_broken_instance_is_not_released():
    events = [ROLE, *TEXT, FINISH, DONE]
    stack, (prefill, broken, refusing) = fakes(json_reply(completion("x", kv_transfer_params=WITH_ID)),
                                               sse_reply(events, break_after=1),
                                               json_reply(refusal(400), status=400))
    instances = [(prefill.url, "prefill"), (broken.url, "decode"), (refusing.url, "decode")]
    with stack, running_router(instances, health_interval_s=60, decode_routing_policy="round_robin") as router:
        with httpx.stream("POST", f"{router.url}/v1/completions", json={**CLIENT_BODY, "stream": True},
                          timeout=30) as response:
            assert response.status_code == 400
        assert "kv_transfer_params" in broken.bodies[0]
        assert "kv_transfer_params" not in refusing.bodies[0]
        assert prefill.releases == []  # the broken instance may be reading them: the expiry frees them
