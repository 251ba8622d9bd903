"""What the xPyD-across-hosts tests run: ``tandem serve --config FILE`` instances, each in its own
test host (tests/helpers/netns.py) on its address, KV over NIXL with ``UCX_TLS=tcp`` across the
veth bridge; ``tandem router --config FILE`` in the test's namespace; and a load of concurrent
streams through the router during which instances are killed with -9.

    test namespace: the test, the router (127.0.0.1), the bridge 10.A.B.1
      host 1  10.A.B.2:8000  prefill      host 3  10.A.B.4:8000  decode
      host 2  10.A.B.3:8000  prefill      host 4  10.A.B.5:8000  decode
"""
from __future__ import annotations

import asyncio
import json
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tandem.bench.cluster_io import child_env, toml  # noqa: F401 - test_xpyd_hosts imports toml from here
from tandem.config import DisaggregationConfig
from tests.helpers.netns import HOST_DEVICE, Host, TestHosts
from tests.router.instances import MODEL_NAME, scrape

PORT = 8000
"""Every instance listens on this port of its own host's address."""
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": HOST_DEVICE, "OMP_NUM_THREADS": "1"}
SECRET = secrets.token_hex(16)
BUSY_GAUGES = ("tandem:num_requests_running", "tandem:num_requests_waiting",
               "tandem:kv_blocks_pending_release")


def secret_settings() -> dict[str, str]:
    """The cluster secret, where this tandem has one (``disaggregation.kv_transfer_secret``)."""
    if "kv_transfer_secret" in DisaggregationConfig.model_fields:
        return {"kv_transfer_secret": SECRET}
    return {}


ADMIN_KEY = secrets.token_hex(16)
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN_KEY}"}
"""The router's admin key: its /health lists the instances only to the admin."""


def kv_headers() -> dict[str, str]:
    """The headers the router adds to a hand-over: the cluster secret, where there is one."""
    return {"X-Tandem-KV-Secret": SECRET} if secret_settings() else {}




@dataclass
class HostedInstance:
    """``tandem serve --config FILE`` of ``role`` in ``host``, listening on its address:PORT."""

    host: Host
    role: str
    config_path: Path
    log_path: Path
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host.address}:{PORT}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> HostedInstance:
        with open(self.log_path, "a") as log:
            self.proc = self.host.popen([sys.executable, "-m", "tandem.cli", "serve", "--config",
                                         str(self.config_path)], env=child_env(**UCX_ENV),
                                        stdout=log, stderr=subprocess.STDOUT)
        return self

    def wait_ready(self, timeout_s: float = 240.0) -> HostedInstance:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"{self.role} {self.url} exited:\n{self.log_tail()}"
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.role} {self.url} did not start:\n{self.log_tail()}")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(30)

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text()[-chars:]


@dataclass
class XPyD:
    net: TestHosts
    prefill: list[HostedInstance]
    decode: list[HostedInstance]
    router_url: str
    router_log: Path

    @property
    def instances(self) -> list[HostedInstance]:
        return self.prefill + self.decode

    def healthy(self) -> set[str]:
        """The instance URLs the router's /health lists as healthy."""
        try:
            listed = httpx.get(f"{self.router_url}/health", timeout=5, headers=ADMIN_HEADERS).json()["instances"]
        except (httpx.HTTPError, ValueError, KeyError):
            return set()
        return {i["url"] for i in listed if i["healthy"]}

    def logs(self) -> str:
        tails = [f"--- {i.role} {i.url}\n{i.log_tail(1500)}" for i in self.instances]
        return "\n".join(tails) + f"\n--- router\n{self.router_log.read_text()[-1500:]}"


def instance_config(model_dir: Path, host: Host, role: str, engine: dict, disaggregation: dict) -> dict:
    return {"model": {"path": str(model_dir), "served_model_name": MODEL_NAME}, "engine": engine,
            "server": {"host": host.address, "port": PORT},
            "disaggregation": {"role": role, "kv_connector": "nixl", **disaggregation, **secret_settings()}}


def router_config(port: int, instances: list[HostedInstance], disaggregation: dict) -> dict:
    return {"server": {"host": "127.0.0.1", "port": port},
            "disaggregation": {"instances": [{"url": i.url, "role": i.role} for i in instances],
                               "router_admin_key": ADMIN_KEY, **disaggregation, **secret_settings()}}


def start_router(config_path: Path, log_path: Path, health_interval_s: float) -> subprocess.Popen:
    with open(log_path, "w") as log:
        return subprocess.Popen([sys.executable, "-m", "tandem.cli", "router", "--config", str(config_path),
                                 "--health-interval-s", str(health_interval_s)],
                                env=child_env(), stdout=log, stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def metric(url: str, name: str) -> float:
    return scrape(url).get(name, 0.0)


def blocks_held(url: str) -> tuple[float, float]:
    """(KV blocks in use, KV blocks pinned for a decode instance) of ``url``."""
    metrics = scrape(url)
    return metrics["tandem:kv_blocks_used"], metrics["tandem:kv_blocks_pending_release"]


def kv_load_failures(url: str) -> float:
    return sum(v for k, v in scrape(url).items() if k.startswith("tandem:kv_transfer_failures_total"))


def upstream_outcomes(router_url: str) -> dict[str, float]:
    """The router's attempts on instances by "step:outcome", summed over instances."""
    counts: dict[str, float] = {}
    for key, value in scrape(router_url).items():
        if key.startswith("tandem:router_upstream_requests_total{"):
            labels = dict(part.split("=", 1) for part in key[key.index("{") + 1:-1].split(","))
            name = f"{labels['step']}:{labels['outcome']}"
            counts[name] = counts.get(name, 0) + value
    return counts


# --------------------------------------------------------------------------- load with kills

OUTCOME_KINDS = ("ok", "wrong_text", "error_status", "error_event", "broken", "hang")


@dataclass
class Outcome:
    """One streamed request of the load. ``kind`` is one of OUTCOME_KINDS: "ok" (the oracle's
    text), "wrong_text", "error_status" (a 4xx/5xx with an OpenAI error body), "error_event"
    (one in the stream, then [DONE]), "broken" (anything else: a cut stream, an error without a
    message) or "hang" (no end within the bound)."""

    started: float
    seconds: float
    kind: str
    detail: str = ""


@dataclass
class Kill:
    """When the victims were killed, their busy gauges just before, and how long the router's
    /health took to list them all as unhealthy (None: it never did within 15 s)."""

    at: float
    held: dict[str, dict[str, float]]
    out_of_rotation_s: float | None = None


@dataclass
class Load:
    """Streams sent by ``streams`` workers in turn, each request of ``prompts[i]`` expected to
    answer ``expected[i]`` (cycled) within ``bound_s``; ``body(prompt)`` is the request body."""

    router_url: str
    prompts: list[list[int]]
    expected: list[str]
    body: Callable[..., dict]
    streams: int
    bound_s: float
    outcomes: list[Outcome] = field(default_factory=list)

    def run_with_kills(self, victims: list[HostedInstance], warmup_s: float, after_s: float) -> Kill:
        """Run the load, kill -9 the victims at the first moment after ``warmup_s`` when they
        all hold work (``kill_when_busy``), and stop sending ``after_s`` after the kill."""
        return asyncio.run(self._run(victims, warmup_s, after_s))

    def kinds(self) -> dict[str, int]:
        return {k: sum(o.kind == k for o in self.outcomes) for k in OUTCOME_KINDS}

    async def _run(self, victims: list[HostedInstance], warmup_s: float, after_s: float) -> Kill:
        stop_at = [float("inf")]
        counter = iter(range(10**9))

        async def worker(client: httpx.AsyncClient) -> None:
            while time.monotonic() < stop_at[0]:
                i = next(counter) % len(self.prompts)
                self.outcomes.append(await self._one(client, self.prompts[i], self.expected[i]))

        async with httpx.AsyncClient(timeout=httpx.Timeout(self.bound_s + 10),
                                     limits=httpx.Limits(max_connections=None)) as client:
            workers = [asyncio.ensure_future(worker(client)) for _ in range(self.streams)]
            await asyncio.sleep(warmup_s)
            kill = await kill_when_busy(client, self.router_url, victims)
            stop_at[0] = kill.at + after_s
            await asyncio.gather(*workers)
        for victim in victims:
            victim.proc.wait(30)
        return kill

    async def _one(self, client: httpx.AsyncClient, prompt: list[int], expected: str) -> Outcome:
        started = time.monotonic()
        try:
            kind, detail = await asyncio.wait_for(self._stream(client, prompt, expected), self.bound_s)
        except asyncio.TimeoutError:
            kind, detail = "hang", f"no answer within {self.bound_s:.0f} s"
        except httpx.TransportError as exc:
            kind, detail = "broken", f"{type(exc).__name__}: {exc}"
        return Outcome(started, time.monotonic() - started, kind, detail)

    async def _stream(self, client: httpx.AsyncClient, prompt: list[int], expected: str) -> tuple[str, str]:
        body = self.body(prompt, stream=True)
        async with client.stream("POST", f"{self.router_url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                clear = response.status_code >= 400 and error_message(text) is not None
                return "error_status" if clear else "broken", f"{response.status_code} {text[:200]}"
            events = [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]
        if events[-1:] != ["[DONE]"]:
            return "broken", f"the stream ended without [DONE] after {len(events)} events"
        if "[DONE]" in events[:-1]:
            return "broken", f"[DONE] more than once in {len(events)} events"
        try:
            chunks = [json.loads(e) for e in events[:-1]]
        except ValueError as exc:
            return "broken", f"an event that is not JSON ({exc}) in {events[:-1]!r}"[:300]
        errors = [json.dumps(c) for c in chunks if "error" in c]
        if errors:
            return "error_event" if error_message(errors[0]) else "broken", errors[0][:200]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        return ("ok", "") if text == expected else ("wrong_text", f"{text!r} != {expected!r}")


def error_message(body: str) -> str | None:
    """The message of an OpenAI-style error body ``{"error": {"message": ...}}``, if it is one."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return None
    return message if isinstance(message, str) and message else None


async def busy_gauges(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    text = (await client.get(f"{url}/metrics")).text
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line.split(" ", 1)[0] in BUSY_GAUGES}


def is_busy(gauges: dict[str, float]) -> bool:
    return any(gauges.get(name, 0) > 0 for name in BUSY_GAUGES)


async def kill_when_busy(client: httpx.AsyncClient, router_url: str, victims: list[HostedInstance],
                         timeout_s: float = 20.0) -> Kill:
    """``kill -9`` of every victim at the first moment they all hold work (requests, or blocks
    pinned for a decode instance), or after ``timeout_s``; then wait for the router to notice."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = {v.url: await busy_gauges(client, v.url) for v in victims}
        if all(is_busy(g) for g in held.values()) or time.monotonic() > deadline:
            break
    kill = Kill(time.monotonic(), held)
    for victim in victims:
        victim.proc.kill()
    urls = {v.url for v in victims}
    while time.monotonic() < kill.at + 15:
        listed = (await client.get(f"{router_url}/health", headers=ADMIN_HEADERS)).json()["instances"]
        if not any(i["healthy"] for i in listed if i["url"] in urls):
            kill.out_of_rotation_s = time.monotonic() - kill.at
            break
        await asyncio.sleep(0.02)
    return kill
