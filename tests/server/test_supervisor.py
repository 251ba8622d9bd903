"""``tandem serve --disaggregated`` as a user runs it: one command, a router in front of a prefill
and a decode instance. Requests through it are disaggregated; a killed child is restarted and
serves again, one that keeps dying makes the command exit non-zero; SIGTERM stops every child and
exits 0. Each start of the command costs three processes, so one start checks all it can."""
from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import stat
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.router.instances import free_port, scrape, wait_for

pytest.importorskip("nixl_cu12", reason="the nixl KV connector needs nixl-cu12")


STATE_DIR = Path(tempfile.mkdtemp(prefix="tandem-state-"))
"""The commands' state directory: where they write the secrets they make."""


def start(model_dir, port: int, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "TANDEM_ENGINE__NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
           "TANDEM_STATE_DIR": str(STATE_DIR)}
    return subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "serve", "--disaggregated", str(model_dir),
         "--port", str(port), "--served-model-name", "tiny", "--num-kv-blocks", "64", *extra],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def child_pids(lines: list[str]) -> dict[str, int]:
    return {m.group(1): int(m.group(2)) for line in lines
            if (m := re.search(r"started the (\w+) process \(pid (\d+)\)", line))}


def read_lines(proc: subprocess.Popen, count: int) -> list[str]:
    return [proc.stdout.readline() for _ in range(count)]


def read_until(proc: subprocess.Popen, text: str) -> str:
    """The first line of the command's output (from here on) that contains ``text``."""
    for line in proc.stdout:
        if text in line:
            return line
    raise AssertionError(f"the command ended without saying {text!r}")


def answered(url: str) -> bool:
    try:
        response = httpx.post(f"{url}/v1/completions", timeout=30,
                              json={"model": "tiny", "prompt": [5, 6, 7, 8, 9], "max_tokens": 4})
    except httpx.TransportError:
        return False
    return response.status_code == 200


def secret_file(url: str, name: str) -> Path:
    """Where the command serving at ``url`` wrote the secret ``name`` it made."""
    return STATE_DIR / f"disaggregated-{url.rsplit(':', 1)[1]}" / name


def admin_health(url: str) -> httpx.Response:
    """The router's /health with the admin key the command made: the instances are listed."""
    key = secret_file(url, "router_admin_key").read_text().strip()
    return httpx.get(f"{url}/health", timeout=5, headers={"Authorization": f"Bearer {key}"})


def all_instances_healthy(url: str) -> bool:
    """The router sees both children: until the prefill instance is healthy, the router rightly
    prefills on the decode instance, which is not the path this test checks."""
    try:
        health = admin_health(url)
    except (httpx.TransportError, FileNotFoundError):
        return False
    instances = health.json().get("instances", []) if health.status_code == 200 else []
    return len(instances) == 2 and all(i["healthy"] for i in instances)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(360)
def test_one_command_serves_disaggregated_restarts_a_dead_child_and_stops_on_sigterm(model_dir):
    """One start of the command for three behaviours (each start costs three processes): it
    serves disaggregated with made secrets; a killed decode child is restarted and serves again;
    SIGTERM stops every child and exits 0."""
    port = free_port()
    proc = start(model_dir, port)
    try:
        pids = child_pids(read_lines(proc, 3))
        assert set(pids) == {"prefill", "decode", "router"}
        url = f"http://127.0.0.1:{port}"
        assert wait_for(lambda: all_instances_healthy(url), 180)
        assert answered(url)
        assert scrape(url)["tandem:router_requests_total{path=disaggregated}"] >= 1
        # the children share a secret this test does not know: hand-overs need it
        instances = admin_health(url).json()["instances"]
        prefill = next(i["url"] for i in instances if i["role"] == "prefill")
        assert httpx.get(f"{prefill}/kv/handshake", timeout=5).status_code == 401
        # the made secrets are the operator's alone, and nobody else sees the instances
        for name in ("router_admin_key", "kv_transfer_secret"):
            path = secret_file(url, name)
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
            assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        secret = secret_file(url, "kv_transfer_secret").read_text().strip()
        key = secret_file(url, "router_admin_key").read_text().strip()
        assert httpx.get(f"{prefill}/kv/handshake", timeout=5,
                         headers={"X-Tandem-KV-Secret": secret}).status_code == 200
        assert httpx.get(f"{url}/health", timeout=5).json() == {"status": "ok"}
        assert httpx.get(f"{url}/admin/instances", timeout=5).status_code == 401
        commands = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        assert secret not in commands and key not in commands

        os.kill(pids["decode"], signal.SIGKILL)
        line = read_until(proc, f"the decode process (pid {pids['decode']}) exited with status -9; restarted it")
        restarted = int(re.search(r"restarted it \(pid (\d+)\)", line).group(1))
        assert wait_for(lambda: all_instances_healthy(url) and answered(url), 180)
        assert alive(pids["prefill"]) and alive(pids["router"]) and proc.poll() is None

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert not any(alive(pid) for pid in (*pids.values(), restarted))
    finally:
        proc.kill()


@pytest.mark.timeout(300)
def test_tensor_parallel_instances_on_both_sides_answer_like_one_process(model_dir):
    from tandem import LLM, SamplingParams

    prompt = [5, 6, 7, 8, 9, 10, 11]
    want = LLM(model=str(model_dir), num_kv_blocks=64).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0].text
    port = free_port()
    proc = start(model_dir, port, "-tp", "2")
    try:
        url = f"http://127.0.0.1:{port}"
        assert wait_for(lambda: all_instances_healthy(url), 240)
        answer = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == want
        assert scrape(url)["tandem:router_requests_total{path=disaggregated}"] >= 1
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


@pytest.mark.timeout(240)
def test_a_crash_looping_child_stops_the_command_with_status_1(model_dir):
    from tandem.server.supervisor import MAX_RESTARTS

    proc = start(model_dir, free_port())
    try:
        pids = child_pids(read_lines(proc, 3))
        pid = pids["decode"]
        for _ in range(MAX_RESTARTS):
            os.kill(pid, signal.SIGKILL)
            line = read_until(proc, f"(pid {pid}) exited")
            pid = int(re.search(r"restarted it \(pid (\d+)\)", line).group(1))
        os.kill(pid, signal.SIGKILL)
        assert proc.wait(60) == 1
        assert f"{MAX_RESTARTS + 1}th exit within" in proc.stdout.read()
        assert wait_for(lambda: not alive(pids["prefill"]) and not alive(pids["router"]), 30)
    finally:
        proc.kill()


def test_the_children_share_a_generated_secret_that_no_config_file_holds(tmp_path, monkeypatch):
    from tandem.config import load_config
    from tandem.server.supervisor import ADMIN_KEY_ENV, SECRET_ENV, plan_children

    monkeypatch.setenv("TANDEM_STATE_DIR", str(tmp_path / "state"))
    config = load_config(overrides={"model.path": "/m"}, env={}, check_plugins=False)
    children = plan_children(config, tmp_path, "warning")
    secret, key = children[2].env[SECRET_ENV], children[2].env[ADMIN_KEY_ENV]
    assert [c.name for c in children] == ["prefill", "decode", "router"]
    assert all(c.env == {SECRET_ENV: secret} for c in children[:2]) and len(secret) >= 32
    assert children[2].env == {SECRET_ENV: secret, ADMIN_KEY_ENV: key} and len(key) >= 32
    assert not any(secret in f.read_text() or key in f.read_text() for f in tmp_path.glob("*.toml"))
    assert not any(secret in arg or key in arg for c in children for arg in c.argv)
    assert plan_children(config, tmp_path, "warning")[0].env[SECRET_ENV] != secret  # random each time
    mine = "the-operator-chose-this-secret"
    configured = load_config(overrides={"model.path": "/m", "kv_transfer_secret": mine}, env={},
                             check_plugins=False)
    assert {c.env[SECRET_ENV] for c in plan_children(configured, tmp_path, "warning")} == {mine}
    assert not any(mine in f.read_text() for f in tmp_path.glob("*.toml"))


def test_keys_from_files_reach_the_children_by_their_environment_only(tmp_path, monkeypatch):
    from tandem.config import load_config
    from tandem.server.supervisor import ADMIN_KEY_ENV, API_KEY_ENV, SECRET_ENV, plan_children

    monkeypatch.setenv("TANDEM_STATE_DIR", str(tmp_path / "state"))
    files = {}
    for name, value in [("api_key", "client-key-0123"), ("router_admin_key", "admin-key-0123"),
                        ("kv_transfer_secret", "cluster-secret-0123456")]:
        files[name] = tmp_path / name
        files[name].write_text(value + "\n")
    config = load_config(overrides={"model.path": "/m", "server.api_key_file": str(files["api_key"]),
                                    "router_admin_key_file": str(files["router_admin_key"]),
                                    "kv_transfer_secret_file": str(files["kv_transfer_secret"])},
                         env={}, check_plugins=False)
    (tmp_path / "conf").mkdir()
    router = plan_children(config, tmp_path / "conf", "warning")[2]
    assert router.env == {SECRET_ENV: "cluster-secret-0123456", ADMIN_KEY_ENV: "admin-key-0123",
                          API_KEY_ENV: "client-key-0123"}
    assert not (tmp_path / "state").exists()  # nothing was made, nothing written
    child = load_config(router.argv[router.argv.index("--config") + 1], env=router.env, check_plugins=False)
    assert child.server.api_key.get_secret_value() == "client-key-0123"
    assert child.disaggregation.router_admin_key.get_secret_value() == "admin-key-0123"


def test_instances_publishing_kv_events_each_take_free_ports(tmp_path, monkeypatch):
    from tandem.config import load_config
    from tandem.config_flags import add_config_flags, flags_to_overrides
    from tandem.server.supervisor import plan_children

    monkeypatch.setenv("TANDEM_STATE_DIR", str(tmp_path / "state"))
    config = load_config(overrides={"model.path": "/m", "kv_events.enabled": True}, env={}, check_plugins=False)
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    for child in plan_children(config, tmp_path, "warning")[:2]:
        args, _ = parser.parse_known_args(child.argv[child.argv.index("serve") + 1:])
        child_config = load_config(args.config_file, flags_to_overrides(args), env={}, check_plugins=False)
        assert child_config.kv_events.enabled
        assert child_config.kv_events.endpoint == child_config.kv_events.replay_endpoint == "tcp://127.0.0.1:0"
    plain = load_config(overrides={"model.path": "/m"}, env={}, check_plugins=False)
    assert not any("--kv-events-endpoint" in c.argv for c in plan_children(plain, tmp_path, "warning"))
