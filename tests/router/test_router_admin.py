"""The admin endpoints add and remove instances at run time behind the router's own bearer key
(401 without it, off with a 403 when the router has none); an added instance is checked at once
and serves the next request."""
from __future__ import annotations

import httpx
import pytest

from tests.router.instances import MODEL_NAME, completion, running_router

KEY = "admin-secret"
BODY = {"model": MODEL_NAME, "prompt": "Instances come and go", "max_tokens": 6, "temperature": 0}


def admin(router, method: str, key: str | None = KEY, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, f"{router.url}/admin/instances", headers=headers, timeout=10, **kwargs)


@pytest.fixture
def router():
    with running_router([], router_admin_key=KEY) as server:
        yield server


@pytest.mark.parametrize("key", [None, "wrong"], ids=["no key", "wrong key"])
@pytest.mark.parametrize("method, kwargs", [
    ("GET", {}),
    ("POST", {"json": {"url": "http://127.0.0.1:9", "role": "decode"}}),
    ("DELETE", {"params": {"url": "http://127.0.0.1:9"}}),
])
def test_admin_routes_need_the_admin_key(router, method, kwargs, key):
    answer = admin(router, method, key, **kwargs)
    assert answer.status_code == 401
    assert answer.json()["error"]["code"] == "invalid_admin_key"
    assert admin(router, "GET").json() == {"instances": []}


def test_an_added_instance_serves_and_a_removed_one_no_longer_does(cluster, router):
    decode = cluster.decode[0].url
    expected = completion(decode, BODY)["choices"][0]["text"]
    assert httpx.post(f"{router.url}/v1/completions", json=BODY, timeout=10).status_code == 503

    added = admin(router, "POST", json={"url": decode + "/", "role": "decode"})
    assert added.status_code == 201
    assert (added.json()["url"], added.json()["role"], added.json()["healthy"]) == (decode, "decode", True)
    assert completion(router.url, BODY)["choices"][0]["text"] == expected
    assert [i["url"] for i in admin(router, "GET").json()["instances"]] == [decode]

    assert admin(router, "DELETE", params={"url": decode}).status_code == 200
    assert admin(router, "GET").json() == {"instances": []}
    assert httpx.post(f"{router.url}/v1/completions", json=BODY, timeout=10).status_code == 503


def test_an_unreachable_instance_is_added_out_of_rotation(router):
    added = admin(router, "POST", json={"url": "http://127.0.0.1:9", "role": "both"})
    assert added.status_code == 201
    assert added.json()["healthy"] is False
    assert added.json()["reason"].startswith("health check failed")


@pytest.mark.parametrize("body, status, code", [
    ({"url": "ftp://somewhere", "role": "decode"}, 400, "invalid_request"),
    ({"url": "http://127.0.0.1:9", "role": "router"}, 400, "invalid_request"),
    ({"url": "http://127.0.0.1:9"}, 400, "invalid_request"),
])
def test_invalid_instances_are_refused(router, body, status, code):
    answer = admin(router, "POST", json=body)
    assert (answer.status_code, answer.json()["error"]["code"]) == (status, code)


def test_duplicates_and_unknown_instances(router):
    instance = {"url": "http://127.0.0.1:9", "role": "decode"}
    assert admin(router, "POST", json=instance).status_code == 201
    assert admin(router, "POST", json=instance).status_code == 409
    assert admin(router, "DELETE", params={"url": "http://127.0.0.1:10"}).status_code == 404


@pytest.mark.parametrize("method, kwargs", [
    ("GET", {}),
    ("POST", {"json": {"url": "http://127.0.0.1:9", "role": "decode"}}),
    ("DELETE", {"params": {"url": "http://127.0.0.1:9"}}),
])
def test_without_an_admin_key_the_admin_routes_are_off(method, kwargs):
    with running_router([], router_admin_key=None) as router:
        for key in (None, "anything"):
            answer = admin(router, method, key, **kwargs)
            assert answer.status_code == 403
            error = answer.json()["error"]
            assert error["code"] == "admin_api_disabled" and "disaggregation.router_admin_key" in error["message"]


def test_a_router_without_the_cluster_secret_refuses_prefill_and_decode_instances():
    with running_router([], kv_transfer_secret=None, router_admin_key=KEY) as bare:
        for role in ("prefill", "decode"):
            answer = admin(bare, "POST", json={"url": "http://127.0.0.1:9", "role": role})
            assert answer.status_code == 400 and answer.json()["error"]["code"] == "no_kv_transfer_secret"
        assert admin(bare, "POST", json={"url": "http://127.0.0.1:9", "role": "both"}).status_code == 201
