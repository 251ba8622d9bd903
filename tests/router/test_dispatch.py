"""The router's side of the disaggregated protocol, against recording stand-ins for instances
(tests/router/fakes.py): what the prefill and decode instances receive, how answers and streams
come back, and what happens when an instance refuses, is busy or breaks. Expected bodies and
event sequences are written out by hand from the flow of docs/architecture.md §9."""
from __future__ import annotations

import json
from contextlib import ExitStack

import httpx

from tests.router.fakes import FakeInstance, completion, event, json_reply, sse_reply
from tests.router.instances import dispatched, router_instance, running_router, upstream

HAND_OVER = {"engine_id": "prefill-0", "handshake_url": "http://127.0.0.1:9/kv/handshake",
             "block_ids": [3, 4], "num_tokens": 20, "compat_hash": "0123abcd"}
CLIENT_BODY = {"model": "tiny", "prompt": "a prompt of some length", "max_tokens": 7, "temperature": 0}
PREFILL_BODY = {"model": "tiny", "prompt": "a prompt of some length", "max_tokens": 1, "temperature": 0,
                "stream": False, "n": 1, "kv_transfer_params": {"do_remote_decode": True}}
ROLE = event({"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                      "finish_reason": None}]})
TEXT = [event({"id": "c", "choices": [{"index": 0, "text": t, "finish_reason": None}]}) for t in ("Hel", "lo")]
FINISH = event({"id": "c", "choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
DONE = "data: [DONE]\n\n"


def post(router, body, path="/v1/completions") -> httpx.Response:
    return httpx.post(f"{router.url}{path}", json=body, timeout=30)


def stream_text(router, body) -> str:
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return response.read().decode()


def fakes(*replies) -> tuple[ExitStack, list[FakeInstance]]:
    stack = ExitStack()
    return stack, [stack.enter_context(FakeInstance(r)) for r in replies]


def test_the_hand_over_goes_from_the_prefill_answer_to_the_decode_request():
    stack, (prefill, decode) = fakes(json_reply(completion("x", kv_transfer_params=HAND_OVER)),
                                     json_reply(completion("decoded")))
    with stack, running_router([(prefill.url, "prefill"), (decode.url, "decode")]) as router:
        answer = post(router, {**CLIENT_BODY, "kv_transfer_params": {"block_ids": [99]}})
        assert answer.status_code == 200
        assert answer.json() == completion("decoded")
        assert prefill.bodies == [PREFILL_BODY]
        assert decode.bodies == [{**CLIENT_BODY, "kv_transfer_params": {**HAND_OVER, "do_remote_prefill": True}}]
        assert dispatched(router.url, "disaggregated") == 1


def test_a_prefill_answer_without_hand_over_leaves_the_prompt_to_the_decode_instance():
    stack, (prefill, decode) = fakes(json_reply(completion("x")), json_reply(completion("decoded")))
    with stack, running_router([(prefill.url, "prefill"), (decode.url, "decode")]) as router:
        assert post(router, CLIENT_BODY).json() == completion("decoded")
        assert decode.bodies == [CLIENT_BODY]


def test_chat_requests_follow_the_same_flow():
    chat = {"messages": [{"role": "user", "content": "Say hello to the router"}], "max_completion_tokens": 5}
    stack, (prefill, decode) = fakes(json_reply({"choices": [], "kv_transfer_params": HAND_OVER}),
                                     json_reply({"object": "chat.completion", "choices": []}))
    with stack, running_router([(prefill.url, "prefill"), (decode.url, "decode")]) as router:
        assert post(router, chat, "/v1/chat/completions").json() == {"object": "chat.completion", "choices": []}
        assert prefill.bodies == [{"messages": chat["messages"], "max_tokens": 1, "stream": False, "n": 1,
                                   "kv_transfer_params": {"do_remote_decode": True}}]
        assert decode.bodies == [{**chat, "kv_transfer_params": {**HAND_OVER, "do_remote_prefill": True}}]


def test_streams_are_relayed_unchanged():
    events = [ROLE, *TEXT, FINISH, DONE]
    stack, (prefill, decode) = fakes(json_reply(completion("x", kv_transfer_params=HAND_OVER)),
                                     sse_reply(events))
    with stack, running_router([(prefill.url, "prefill"), (decode.url, "decode")]) as router:
        assert stream_text(router, {**CLIENT_BODY, "stream": True}) == "".join(events)
        assert decode.bodies[0]["stream"] is True
        assert decode.bodies[0]["kv_transfer_params"]["do_remote_prefill"] is True


def test_a_stream_that_breaks_before_its_first_token_is_retried_without_the_hand_over():
    events = [ROLE, *TEXT, FINISH, DONE]
    stack, (prefill, broken, good) = fakes(json_reply(completion("x", kv_transfer_params=HAND_OVER)),
                                           sse_reply(events, break_after=1), sse_reply(events))
    instances = [(prefill.url, "prefill"), (broken.url, "decode"), (good.url, "decode")]
    with stack, running_router(instances, health_interval_s=60, decode_routing_policy="round_robin") as router:
        assert stream_text(router, {**CLIENT_BODY, "stream": True}) == "".join(events)
        assert "kv_transfer_params" in broken.bodies[0]
        # the broken instance may have claimed the prefill's blocks: the retry recomputes
        assert good.bodies == [{**CLIENT_BODY, "stream": True}]
        assert upstream(router.url, broken.url, "decode", "unreachable") == 1
        assert upstream(router.url, good.url, "decode", "ok") == 1
        assert router_instance(router.url, broken.url)["healthy"] is False


def test_a_stream_that_breaks_after_its_first_token_ends_with_an_error_event():
    stack, (decode,) = fakes(sse_reply([ROLE, TEXT[0], TEXT[1], FINISH, DONE], break_after=2))
    with stack, running_router([(decode.url, "decode")], health_interval_s=60) as router:
        text = stream_text(router, {**CLIENT_BODY, "stream": True})
        relayed = text.split("\n\n")
        assert relayed[:2] == [ROLE.strip(), TEXT[0].strip()]
        assert json.loads(relayed[2].removeprefix("data: "))["error"]["code"] == "instance_failed"
        assert relayed[3:] == ["data: [DONE]", ""]
        assert upstream(router.url, decode.url, "decode", "broken") == 1
        assert router_instance(router.url, decode.url)["healthy"] is False


def test_an_instance_that_dies_after_its_done_event_leaves_the_stream_whole():
    # kill -9 of a decode instance between its [DONE] and the end of the chunked body: the
    # client's stream is already complete, with exactly one [DONE] and no error event
    events = [ROLE, TEXT[0], TEXT[1], FINISH, DONE]
    stack, (decode,) = fakes(sse_reply(events, break_after=len(events)))
    with stack, running_router([(decode.url, "decode")], health_interval_s=60) as router:
        assert stream_text(router, {**CLIENT_BODY, "stream": True}) == "".join(events)
        assert upstream(router.url, decode.url, "decode", "ok") == 1


def test_finished_streams_leave_their_connection_open_for_the_next_request():
    # after [DONE] the router reads the end of the body, so the instance's connection goes back
    # to the pool: two streams in a row arrive over the same connection (the same client port)
    events = [ROLE, TEXT[0], TEXT[1], FINISH, DONE]
    stack, (decode,) = fakes(sse_reply(events))
    with stack, running_router([(decode.url, "decode")], health_interval_s=60) as router:
        for _ in range(2):
            assert stream_text(router, {**CLIENT_BODY, "stream": True}) == "".join(events)
        assert len(decode.peers) == 2 and decode.peers[0] == decode.peers[1], decode.peers


def test_a_refused_prefill_is_relayed_and_nothing_is_decoded():
    error = {"error": {"message": "max_tokens: bad", "type": "invalid_request_error", "param": "max_tokens",
                       "code": "invalid_request"}}
    stack, (prefill, decode) = fakes(json_reply(error, status=400), json_reply(completion("decoded")))
    with stack, running_router([(prefill.url, "prefill"), (decode.url, "decode")]) as router:
        answer = post(router, CLIENT_BODY)
        assert (answer.status_code, answer.json()) == (400, error)
        assert decode.bodies == []
        assert upstream(router.url, prefill.url, "prefill", "error") == 1


def test_a_busy_prefill_instance_passes_the_request_to_the_next():
    stack, (busy, prefill, decode) = fakes(json_reply({"error": {}}, status=429),
                                           json_reply(completion("x", kv_transfer_params=HAND_OVER)),
                                           json_reply(completion("decoded")))
    instances = [(busy.url, "prefill"), (prefill.url, "prefill"), (decode.url, "decode")]
    with stack, running_router(instances, routing_policy="round_robin") as router:
        assert post(router, CLIENT_BODY).json() == completion("decoded")
        assert busy.bodies == prefill.bodies == [PREFILL_BODY]
        assert decode.bodies[0]["kv_transfer_params"]["engine_id"] == "prefill-0"
        assert upstream(router.url, busy.url, "prefill", "busy") == 1
        assert router_instance(router.url, busy.url)["healthy"] is True  # 429 is no failure


def test_an_unavailable_prefill_instance_leaves_rotation():
    stack, (closing, decode) = fakes(json_reply({"error": {}}, status=503), json_reply(completion("decoded")))
    with stack, running_router([(closing.url, "prefill"), (decode.url, "decode")], health_interval_s=60) as router:
        assert post(router, CLIENT_BODY).json() == completion("decoded")
        assert decode.bodies == [CLIENT_BODY]
        assert dispatched(router.url, "local_prefill") == 1
        assert router_instance(router.url, closing.url)["reason"] == "answered 503"
        post(router, CLIENT_BODY)
        assert len(closing.bodies) == 1  # out of rotation: not asked again


def test_when_every_decode_instance_is_busy_the_last_429_is_relayed():
    stack, (first, second) = fakes(json_reply({"error": {"code": "queue_full"}}, 429, {"Retry-After": "3"}),
                                   json_reply({"error": {"code": "queue_full"}}, 429, {"Retry-After": "4"}))
    with stack, running_router([(first.url, "decode"), (second.url, "decode")],
                               decode_routing_policy="round_robin") as router:
        answer = post(router, CLIENT_BODY)
        assert answer.status_code == 429
        assert answer.headers["retry-after"] == "4"
        assert len(first.bodies) == len(second.bodies) == 1


def test_several_prompts_in_one_request_skip_the_prefill_step():
    stack, (prefill, decode) = fakes(json_reply(completion("x")), json_reply(completion("decoded")))
    with stack, running_router([(prefill.url, "prefill"), (decode.url, "decode")]) as router:
        body = {**CLIENT_BODY, "prompt": ["first prompt", "second prompt"]}
        assert post(router, body).status_code == 200
        assert prefill.bodies == [] and decode.bodies == [body]
        assert dispatched(router.url, "direct") == 1


def test_the_router_answers_bad_json_itself():
    with running_router([]) as router:
        answer = httpx.post(f"{router.url}/v1/completions", content=b"{not json", timeout=10)
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_json"
        answer = httpx.post(f"{router.url}/v1/completions", json=[1, 2], timeout=10)
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_json"


def test_without_a_healthy_decode_instance_the_router_answers_503():
    with running_router([("http://127.0.0.1:9", "decode")]) as router:
        assert httpx.get(f"{router.url}/health", timeout=10).status_code == 503
        answer = post(router, CLIENT_BODY)
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "no_instance"
