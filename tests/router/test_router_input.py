"""The router holds to the instances' rules (issue 11, point 7): a client's bad input gets a 4xx
from the router or from the instance it reaches, never a 5xx; a 5xx comes only from an upstream
failure; a request that an instance fails alone is relayed as it is, and that instance stays in
rotation. Real router app under uvicorn, before recording stand-ins for instances
(tests/router/fakes.py) or the real instances of tests/router/conftest.py; every expected status
and body is written out by hand."""
from __future__ import annotations

import re
from contextlib import ExitStack

import httpx
import pytest
from fastapi.responses import JSONResponse

from tandem.interfaces import InstanceInfo
from tandem.plugins.routing import RoundRobin
from tests.router.fakes import FakeInstance, completion, event, json_reply, sse_reply
from tests.router.instances import ADMIN, router_instance, running_router, upstream, wait_for

BODY = {"model": "tiny", "prompt": "a prompt of some length", "max_tokens": 4}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
INSTANCE_ERROR = {"error": {"message": "the engine failed on this request", "type": "internal_server_error",
                            "param": None, "code": "engine_exception"}}
TEXT = event({"id": "c", "choices": [{"index": 0, "text": "Hi", "finish_reason": None}]})
ERROR_EVENT = event(INSTANCE_ERROR)
DONE = "data: [DONE]\n\n"


def raw_post(router, content: bytes, path: str = "/v1/completions", **headers) -> httpx.Response:
    return httpx.post(f"{router.url}{path}", content=content, timeout=30,
                      headers={"content-type": "application/json", **headers})


def fakes(*replies) -> tuple[ExitStack, list[FakeInstance]]:
    stack = ExitStack()
    return stack, [stack.enter_context(FakeInstance(r)) for r in replies]


# Bodies that json.loads accepts but that are not JSON an instance can be sent (RFC 8259 has no
# NaN or Infinity; a string must be Unicode, and "\ud800" alone is half a surrogate pair), and
# nesting deeper than any parser here goes.
NOT_JSON = {
    "nan": b'{"prompt": "x", "max_tokens": 4, "temperature": NaN}',
    "infinity": b'{"prompt": "x", "max_tokens": 4, "top_p": Infinity}',
    "minus infinity": b'{"prompt": "x", "max_tokens": 4, "presence_penalty": -Infinity}',
    "nan in a stream": b'{"prompt": "x", "max_tokens": 4, "stream": true, "temperature": NaN}',
    "nan in an unknown field": b'{"prompt": "x", "max_tokens": 4, "whatever": [NaN]}',
    "lone surrogate in the prompt": b'{"prompt": "x\\ud800y", "max_tokens": 4}',
    "lone surrogate in a token-id-less stream": b'{"prompt": "\\udfff", "max_tokens": 4, "stream": true}',
    "lone surrogate in a stop string": b'{"prompt": "x", "max_tokens": 4, "stop": ["\\ud83d"]}',
    "lone surrogate in a key": b'{"prompt": "x", "max_tokens": 4, "\\ud800": 1}',
    "deep nesting": b'{"prompt": "x", "max_tokens": 4, "user": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
}
NOT_JSON_CHAT = {
    "lone surrogate in a message": b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 4}',
    "lone surrogate in a text part": b'{"messages": [{"role": "user", "content": [{"type": "text", '
                                     b'"text": "a\\udc00"}]}], "max_tokens": 4}',
    "nan in a chat": b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "top_p": NaN}',
}


@pytest.mark.parametrize("path, content", [
    *[("/v1/completions", c) for c in NOT_JSON.values()],
    *[("/v1/chat/completions", c) for c in NOT_JSON_CHAT.values()],
], ids=[*NOT_JSON, *NOT_JSON_CHAT])
def test_a_body_that_is_not_json_an_instance_can_read_is_a_400_from_the_router(path, content):
    stack, (prefill, decode) = fakes(json_reply(completion("x")), json_reply(completion("decoded")))
    with stack, running_router([(prefill.url, "prefill"), (decode.url, "decode")]) as router:
        answer = raw_post(router, content, path)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["type"] == "invalid_request_error"
        assert answer.json()["error"]["code"] == "invalid_json"
        assert prefill.bodies == [] and decode.bodies == []
        assert raw_post(router, b'{"prompt": "x", "max_tokens": 4}').status_code == 200


@pytest.mark.parametrize("prompt", [[2**64], [2**63], [-1], [5, -(2**63) - 1], [[7, 2**100]]],
                         ids=["2**64", "2**63", "-1", "below int64", "in a nested list"])
@pytest.mark.parametrize("policy", ["prefix_affinity", "round_robin", "least_loaded"])
def test_token_ids_no_vocabulary_has_go_whole_to_the_decode_instance_which_judges_them(prompt, policy):
    refusal = {"error": {"message": "prompt: token id out of range", "type": "invalid_request_error",
                         "param": "prompt", "code": None}}
    stack, (prefill, decode) = fakes(json_reply(completion("x")), json_reply(refusal, status=400))
    with stack, running_router([(prefill.url, "prefill"), (decode.url, "decode")],
                               routing_policy=policy, decode_routing_policy=policy) as router:
        body = {**BODY, "prompt": prompt}
        answer = httpx.post(f"{router.url}/v1/completions", json=body, timeout=30)
        assert (answer.status_code, answer.json()) == (400, refusal)
        assert prefill.bodies == [] and decode.bodies == [body]


@pytest.mark.parametrize("value", [b"Bearer \xe9t\xe9", b"\xff\xfe", b"Bearer key\x80"],
                         ids=["latin-1", "high bytes", "trailing byte"])
def test_header_bytes_that_are_not_ascii_are_relayed_unchanged(value):
    with FakeInstance(json_reply(completion("decoded"))) as decode, \
            running_router([(decode.url, "decode")]) as router:
        answer = httpx.post(f"{router.url}/v1/completions", json=BODY, timeout=30,
                            headers=[(b"authorization", value)])
        assert (answer.status_code, answer.json()) == (200, completion("decoded"))
        assert [dict(h).get(b"authorization") for h in decode.headers] == [value]


def test_a_wrong_api_key_in_bytes_that_are_not_ascii_is_a_401():
    with FakeInstance(json_reply(completion("decoded"))) as decode, \
            running_router([(decode.url, "decode")], api_key="k") as router:
        answer = httpx.post(f"{router.url}/v1/completions", json=BODY, timeout=30,
                            headers=[(b"authorization", b"Bearer \xe9")])
        assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"
        assert decode.bodies == []


@pytest.mark.parametrize("path, body", [("/v1/completions", BODY), ("/v1/chat/completions", CHAT)],
                         ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_request_the_decode_instance_fails_alone_is_relayed_and_the_instance_stays(path, body, stream):
    """A 500 for one request is that request's failure, not the instance's (a 503 would be)."""
    stack, (decode,) = fakes(lambda b: JSONResponse(INSTANCE_ERROR, status_code=500) if b.get("poison")
                             else JSONResponse(completion("fine")))
    with stack, running_router([(decode.url, "decode")], health_interval_s=60) as router:
        answer = httpx.post(f"{router.url}{path}", json={**body, "stream": stream, "poison": True}, timeout=30)
        assert (answer.status_code, answer.json()) == (500, INSTANCE_ERROR)
        assert router_instance(router.url, decode.url)["healthy"] is True
        assert upstream(router.url, decode.url, "decode", "error") == 1
        assert httpx.post(f"{router.url}{path}", json=body, timeout=30).json() == completion("fine")
        assert len(decode.bodies) == 2


def test_a_stream_the_instance_ends_with_an_error_event_is_relayed_and_the_instance_stays():
    stack, (decode,) = fakes(sse_reply([TEXT, ERROR_EVENT, DONE]))
    with stack, running_router([(decode.url, "decode")], health_interval_s=60) as router:
        with httpx.stream("POST", f"{router.url}/v1/completions", json={**BODY, "stream": True},
                          timeout=30) as answer:
            assert answer.status_code == 200
            assert answer.read().decode() == TEXT + ERROR_EVENT + DONE
        assert router_instance(router.url, decode.url)["healthy"] is True
        assert upstream(router.url, decode.url, "decode", "ok") == 1


def test_a_request_the_prefill_instance_fails_alone_is_relayed_and_the_instance_stays():
    stack, (prefill, decode) = fakes(json_reply(INSTANCE_ERROR, status=500), json_reply(completion("decoded")))
    with stack, running_router([(prefill.url, "prefill"), (decode.url, "decode")], health_interval_s=60) as router:
        answer = httpx.post(f"{router.url}/v1/completions", json=BODY, timeout=30)
        assert (answer.status_code, answer.json()) == (500, INSTANCE_ERROR)
        assert decode.bodies == []
        assert router_instance(router.url, prefill.url)["healthy"] is True
        assert upstream(router.url, prefill.url, "prefill", "error") == 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_request_that_breaks_two_instances_is_not_sent_to_a_third(stream):
    """A request whose connection broke after it reached an instance may have killed it; it is
    retried once, and after a second broken instance the client gets a 502 and the other
    instances are spared."""
    stack, instances = fakes(*[sse_reply([TEXT, DONE], break_after=0)] * 3)
    with stack, running_router([(i.url, "decode") for i in instances], health_interval_s=60,
                               decode_routing_policy="round_robin") as router:
        answer = httpx.post(f"{router.url}/v1/completions", json={**BODY, "stream": stream}, timeout=30)
        assert answer.status_code == 502, answer.text
        assert answer.json()["error"]["code"] == "instance_failed"
        assert sorted(len(i.bodies) for i in instances) == [0, 1, 1]
        spared = next(i for i in instances if not i.bodies)
        assert router_instance(router.url, spared.url)["healthy"] is True


def test_a_request_that_breaks_two_prefill_instances_goes_to_no_decode_instance():
    stack, (first, second, decode) = fakes(sse_reply([TEXT, DONE], break_after=0),
                                           sse_reply([TEXT, DONE], break_after=0),
                                           json_reply(completion("decoded")))
    with stack, running_router([(first.url, "prefill"), (second.url, "prefill"), (decode.url, "decode")],
                               health_interval_s=60) as router:
        answer = httpx.post(f"{router.url}/v1/completions", json=BODY, timeout=30)
        assert answer.status_code == 502 and answer.json()["error"]["code"] == "instance_failed"
        assert (len(first.bodies), len(second.bodies), decode.bodies) == (1, 1, [])


def test_one_broken_instance_is_replaced_by_the_next():
    stack, (broken, sound) = fakes(sse_reply([TEXT, DONE], break_after=0), json_reply(completion("decoded")))
    with stack, running_router([(broken.url, "decode"), (sound.url, "decode")], health_interval_s=60,
                               decode_routing_policy="round_robin") as router:
        answer = httpx.post(f"{router.url}/v1/completions", json=BODY, timeout=30)
        assert (answer.status_code, answer.json()) == (200, completion("decoded"))
        assert upstream(router.url, broken.url, "decode", "unreachable") == 1


def test_an_instance_url_httpx_cannot_parse_is_a_400_and_the_health_checks_go_on():
    late = FakeInstance(json_reply(completion("decoded")))  # its port is bound, not yet served
    with running_router([], health_interval_s=0.1) as router:
        bad = httpx.post(f"{router.url}/admin/instances", json={"url": "http://[::1", "role": "decode"}, timeout=10,
                         headers=ADMIN)
        assert bad.status_code == 400, bad.text
        assert (bad.json()["error"]["code"], bad.json()["error"]["param"]) == ("invalid_url", "url")
        assert httpx.get(f"{router.url}/admin/instances", timeout=10, headers=ADMIN).json() == {"instances": []}

        added = httpx.post(f"{router.url}/admin/instances", json={"url": late.url, "role": "decode"}, timeout=10,
                           headers=ADMIN)
        assert added.status_code == 201 and added.json()["healthy"] is False
        with late:  # only the periodic health checks can bring it into rotation now
            assert wait_for(lambda: router_instance(router.url, late.url)["healthy"], 5)
            assert httpx.post(f"{router.url}/v1/completions", json=BODY, timeout=30).json() == completion("decoded")


def test_a_routing_policy_that_picks_a_stranger_is_an_internal_error_in_openai_shape(monkeypatch, caplog):
    """The one 5xx the router makes itself: a bug (here a plugin's); the router goes on serving.
    The body names an error id, not the exception (its text can hold an address or a prompt);
    the log has the exception under that id."""
    stranger = InstanceInfo(url="http://127.0.0.1:9", role="decode", num_waiting=0, num_running=0,
                            kv_usage=0.0, num_in_flight=0)
    with FakeInstance(json_reply(completion("decoded"))) as decode, \
            running_router([(decode.url, "decode")], decode_routing_policy="round_robin") as router:
        with monkeypatch.context() as patch:
            patch.setattr(RoundRobin, "select", lambda self, instances, key: stranger)
            answer = httpx.post(f"{router.url}/v1/completions", json=BODY, timeout=30)
        assert answer.status_code == 500
        assert answer.json()["error"]["code"] == "internal_error"
        message = answer.json()["error"]["message"]
        assert "RuntimeError" not in message and stranger.url not in message
        error_id = re.search(r"error id ([0-9a-f]+)", message).group(1)
        logged = [r for r in caplog.records if error_id in r.getMessage()]
        assert logged and stranger.url in str(logged[0].exc_info[1])
        assert decode.bodies == []
        assert httpx.post(f"{router.url}/v1/completions", json=BODY, timeout=30).json() == completion("decoded")


# Bodies that are JSON objects but not what the API (or core/router/prompts.py) expects, through
# the router to real instances (tests/router/conftest.py), and the status each must get: the
# instance's 400 (404 for an unknown model), relayed; kv_transfer_params are the router's to
# set, so a client's, of any type, is dropped and the request served.
C, CHAT_PATH = "/v1/completions", "/v1/chat/completions"
PROMPT = {"model": "tiny", "prompt": "a prompt long enough to be disaggregated", "max_tokens": 2}
MESSAGES = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
WRONG_TYPES = [
    ("prompt is an object", C, {**PROMPT, "prompt": {"text": "x"}}, 400),
    ("prompt is a number", C, {**PROMPT, "prompt": 5}, 400),
    ("prompt of floats", C, {**PROMPT, "prompt": [1.5, 2.5]}, 400),
    ("prompt of mixed ids", C, {**PROMPT, "prompt": [[1, "a"]]}, 400),
    ("prompt of booleans", C, {**PROMPT, "prompt": [True, False]}, 400),
    ("prompt missing", C, {"model": "tiny", "max_tokens": 2}, 400),
    ("stream is a string", C, {**PROMPT, "stream": "yes"}, 400),
    ("stream is a number", C, {**PROMPT, "stream": 1}, 400),
    ("stream_options is a number", C, {**PROMPT, "stream_options": 5}, 400),
    ("max_tokens is a string", C, {**PROMPT, "max_tokens": "2"}, 400),
    ("logprobs is a string", C, {**PROMPT, "logprobs": "x"}, 400),
    ("n is a string", C, {**PROMPT, "n": "2"}, 400),
    ("temperature is a string", C, {**PROMPT, "temperature": "hot"}, 400),
    ("model is a number", C, {**PROMPT, "model": 5}, 400),
    ("unknown model", C, {**PROMPT, "model": "no-such-model"}, 404),
    ("messages is a string", CHAT_PATH, {**MESSAGES, "messages": "hello"}, 400),
    ("messages of numbers", CHAT_PATH, {**MESSAGES, "messages": [1, 2]}, 400),
    ("messages empty", CHAT_PATH, {**MESSAGES, "messages": []}, 400),
    ("content is a number", CHAT_PATH, {**MESSAGES, "messages": [{"role": "user", "content": 5}]}, 400),
    ("content part not text", CHAT_PATH, {**MESSAGES, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400),
    ("message without role", CHAT_PATH, {**MESSAGES, "messages": [{"content": "hello"}]}, 400),
    ("max_completion_tokens is a string", CHAT_PATH, {**MESSAGES, "max_completion_tokens": "2"}, 400),
    ("kv_transfer_params is a string", C, {**PROMPT, "kv_transfer_params": "x"}, 200),
    ("kv_transfer_params is a list", C, {**PROMPT, "kv_transfer_params": [1]}, 200),
    ("kv_transfer_params claims a hand-over", C,
     {**PROMPT, "kv_transfer_params": {"do_remote_prefill": True, "block_ids": [10**9], "engine_id": 7}}, 200),
    ("kv_transfer_params in a chat", CHAT_PATH, {**MESSAGES, "kv_transfer_params": {"do_remote_decode": "maybe"}}, 200),
]


@pytest.fixture(scope="module")
def real_router(cluster):
    with running_router([(cluster.prefill.url, "prefill"), (cluster.decode[0].url, "decode")],
                        health_interval_s=60) as router:
        yield router


STREAMED = [(f"{name}, streamed", path, {**body, "stream": True}, status)
            for name, path, body, status in WRONG_TYPES if "stream" not in body]


@pytest.mark.parametrize("name, path, body, status", WRONG_TYPES + STREAMED,
                         ids=[c[0] for c in WRONG_TYPES + STREAMED])
def test_wrongly_typed_bodies_get_the_instances_4xx_through_the_router(cluster, real_router, name, path, body,
                                                                        status):
    answer = httpx.post(f"{real_router.url}{path}", json=body, timeout=60)
    assert answer.status_code == status, answer.text
    if status != 200:
        assert answer.json()["error"]["type"] == "invalid_request_error"
    for url in (cluster.prefill.url, cluster.decode[0].url):
        assert router_instance(real_router.url, url)["healthy"] is True
        assert upstream(real_router.url, url, "decode", "unavailable") == 0
