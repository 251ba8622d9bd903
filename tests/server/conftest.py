"""Fixtures of the server tests: the tiny Llama, a shared server, its clients and the oracles."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.helpers.tiny_models import hf_model, tiny_model_dir
from tests.server.server_helpers import ENGINE, ServerThread, running_server, server_config


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def server(model_dir) -> Iterator[ServerThread]:
    """The shared server: tiny Llama, served as "tiny"."""
    with running_server(server_config(model_dir, served_model_name="tiny")) as srv:
        yield srv


@pytest.fixture(scope="session")
def offline(model_dir):
    """The offline API on the same checkpoint and engine settings: the oracle of the server."""
    from tandem import LLM

    return LLM(model=str(model_dir), **ENGINE)


@pytest.fixture(scope="module")
def http(server) -> httpx.Client:
    """An HTTP client of the shared server."""
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir):
    """The checkpoint's tokenizer through HF transformers: the oracle of token counts."""
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    """The official ``openai`` client of the shared server."""
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def hf(model_dir):
    """The checkpoint through HF transformers: the oracle of outputs and logprobs."""
    return hf_model(model_dir)
