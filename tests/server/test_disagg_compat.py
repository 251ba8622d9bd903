"""The KV compat hash covers the weights and the tokenizer (issue 12, point 2): a decode
instance refuses, with a 400 naming both hashes, the hand-over of a prefill instance that serves
another checkpoint of the same architecture and shapes, or the same weights with another
tokenizer; the same checkpoint in another folder is accepted. Prefill and decode servers run in
this process over the loopback connector (as in test_disagg.py)."""
from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

from tandem.models.tokenizer_training import stdlib_corpus_files, train_bpe_tokenizer
from tests.engine.test_greedy_vs_hf import _prompts
from tests.helpers.tiny_models import TINY_VOCAB, build_tiny_model
from tests.server.server_helpers import running_server, server_config

PROMPT = _prompts(80, [2 * 16 + 3])[0]


def _role(model: Path, role: str):
    return server_config(model, served_model_name="tiny", **{
        "disaggregation.role": role, "disaggregation.kv_connector": "loopback",
        "disaggregation.allow_insecure_no_secret": True})


def _body(**extra) -> dict:
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
            **extra}


@pytest.fixture(scope="module")
def prefill(model_dir):
    with running_server(_role(model_dir, "prefill")) as srv:
        yield srv


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory) -> Path:
    """The tiny Llama's architecture and shapes, other weights (another seed)."""
    return build_tiny_model(tmp_path_factory.mktemp("seed2") / "llama", "llama", seed=2)


@pytest.fixture(scope="module")
def other_tokenizer(model_dir, tmp_path_factory) -> Path:
    """The tiny Llama's weights with a tokenizer of the same size trained on another corpus."""
    folder = shutil.copytree(model_dir, tmp_path_factory.mktemp("tok") / "llama")
    train_bpe_tokenizer(TINY_VOCAB, stdlib_corpus_files(4)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def copied(model_dir, tmp_path_factory) -> Path:
    return shutil.copytree(model_dir, tmp_path_factory.mktemp("copy") / "llama")


def hand_over(prefill_url: str) -> dict:
    response = httpx.post(f"{prefill_url}/v1/completions", timeout=60,
                          json=_body(max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    assert response.status_code == 200, response.text
    return {**response.json()["kv_transfer_params"], "do_remote_prefill": True}


@pytest.mark.timeout(180)
def test_other_weights_of_the_same_shapes_are_refused(server, prefill, other_weights):
    with running_server(server_config(other_weights, served_model_name="tiny")) as colocated:
        theirs = httpx.post(f"{colocated.url}/v1/completions", json=_body(), timeout=60).json()
    ours = httpx.post(f"{server.url}/v1/completions", json=_body(), timeout=60).json()
    # the two checkpoints answer differently: decoding one's KV with the other would be wrong
    assert theirs["choices"][0]["text"] != ours["choices"][0]["text"]
    _assert_refused(prefill, other_weights)


@pytest.mark.timeout(180)
def test_another_tokenizer_is_refused(prefill, other_tokenizer):
    _assert_refused(prefill, other_tokenizer)


def _assert_refused(prefill, decode_model: Path) -> None:
    params = hand_over(prefill.url)
    with running_server(_role(decode_model, "decode")) as decode:
        answer = httpx.post(f"{decode.url}/v1/completions", json=_body(kv_transfer_params=params), timeout=60)
        local = decode.engine._engine.kv_transfer.compat_hash
    assert local != params["compat_hash"]
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "kv_transfer_params"
    assert params["compat_hash"] in error["message"] and local in error["message"]
    assert "weights" in error["message"] and "tokenizer" in error["message"]
    httpx.post(f"{prefill.url}/kv/release", json={"transfer_id": params["transfer_id"]}, timeout=10)


@pytest.mark.timeout(180)
def test_the_same_checkpoint_in_another_folder_is_accepted(server, prefill, copied):
    params = hand_over(prefill.url)
    with running_server(_role(copied, "decode")) as decode:
        answer = httpx.post(f"{decode.url}/v1/completions", json=_body(kv_transfer_params=params), timeout=60)
        read = decode.engine._engine.kv_transfer.stats().bytes_total
    assert answer.status_code == 200, answer.text
    assert read > 0  # the KV was read, not recomputed
    oracle = httpx.post(f"{server.url}/v1/completions", json=_body(), timeout=60).json()
    assert answer.json()["choices"][0]["text"] == oracle["choices"][0]["text"]
