"""Clients that read slowly or not at all cost bounded memory, and a stream whose client reads
nothing for ``server.stream_stall_timeout_s`` is aborted and its KV blocks freed.

The server's listening socket gets a small send buffer (accepted sockets inherit it), so that a
client that stops reading blocks the server's writes after some KiB instead of the MiBs Linux
would otherwise buffer: the same code path, reached within a short generation. Oracles:
hand-stated bounds and the offline API's greedy text."""
from __future__ import annotations

import json
import resource
import socket
import time

import httpx

from tandem import SamplingParams
from tandem.server.app import create_app
from tests.server.server_helpers import ServerThread, scrape, server_config

# Short, so that a stalled stream is caught long before the tiny model could finish it (it
# decodes some hundreds of tokens a second on one core).
STALL_TIMEOUT_S = 0.5


def _server(model_dir, stall_timeout_s: float = STALL_TIMEOUT_S, **overrides) -> ServerThread:
    srv = ServerThread(create_app(server_config(model_dir, stream_stall_timeout_s=stall_timeout_s,
                                                **overrides)))
    srv.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
    return srv.start()


def _send_and_never_read(port: int, body: dict) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: tandem\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(data) + data)
    return sock


def _wait_idle(url: str, requests: int, timeout_s: float) -> tuple[float, dict[str, float]]:
    """Waits until ``requests`` requests have ended (succeeded or failed, by the server's
    counters: the server may not even have read a request when this starts) and nothing runs,
    waits or holds a KV block."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        m = scrape(url)
        ended = sum(v for k, v in m.items()
                    if k.startswith(("tandem:request_success_total{", "tandem:request_errors_total{")))
        if ended >= requests and m["tandem:kv_blocks_used"] == 0 and not m["tandem:num_requests_running"] \
                and not m["tandem:num_requests_waiting"]:
            return time.monotonic() - start, m
        time.sleep(0.1)
    raise AssertionError(f"still busy after {timeout_s} s: {m}")


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        kib = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return kib / 1024


def test_a_stream_whose_client_reads_nothing_is_aborted_at_the_timeout(model_dir, offline):
    srv = _server(model_dir, num_kv_blocks=128)
    try:
        # four choices of 480 tokens: several seconds of decoding, and the chunks fill the socket
        # buffers within the first few hundred milliseconds
        n, max_tokens = 4, 480
        sock = _send_and_never_read(srv.port, {"prompt": "def main():", "max_tokens": max_tokens, "n": n,
                                               "ignore_eos": True, "logprobs": 20, "stream": True})
        took, metrics = _wait_idle(srv.url, 1, timeout_s=60)
        sock.close()
        # aborted once its writes stalled, long before generating everything it asked for
        assert metrics.get("tandem:request_errors_total{reason=client_stalled}") == 1, metrics
        assert metrics["tandem:generation_tokens_total"] < n * max_tokens
        assert not srv.engine._streams and not srv.engine._engine.outputs.states
        want = offline.generate(["x = 1"], SamplingParams(temperature=0, max_tokens=8))[0]
        got = httpx.post(f"{srv.url}/v1/completions", timeout=30,
                         json={"prompt": "x = 1", "max_tokens": 8, "temperature": 0}).json()
        assert got["choices"][0]["text"] == want.outputs[0].text
    finally:
        srv.stop()


def test_fifty_streams_that_never_read_leave_memory_flat_and_free_their_blocks(model_dir):
    # a stall caught within 0.1 s: a request that runs while the others wait could otherwise
    # generate all its tokens inside the window (the tiny model decodes ~1000 tokens a second
    # at a small batch) and end as a success with its writes still blocked
    srv = _server(model_dir, stall_timeout_s=0.1, num_kv_blocks=128, max_queued_requests=64)
    try:
        body = {"prompt": "import os", "max_tokens": 480, "ignore_eos": True, "logprobs": 5,
                "stream": True, "temperature": 1.0}
        before = _rss_mib()
        socks = [_send_and_never_read(srv.port, body) for _ in range(50)]
        took, metrics = _wait_idle(srv.url, 50, timeout_s=120)
        grown = _rss_mib() - before
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        for sock in socks:
            sock.close()
        # each one stalled and was aborted, or finished while its last writes were still blocked
        stalled = metrics.get("tandem:request_errors_total{reason=client_stalled}", 0)
        finished = metrics.get("tandem:request_success_total{finish_reason=length}", 0)
        print(f"50 stalled streams: idle again after {took:.1f} s, RSS +{grown:.0f} MiB "
              f"(peak {peak:.0f} MiB), {metrics['tandem:generation_tokens_total']:.0f} tokens, "
              f"{stalled:.0f} aborted as stalled, {finished:.0f} finished")
        assert stalled + finished == 50 and stalled >= 25, (stalled, finished)
        assert grown < 64, f"RSS grew by {grown:.0f} MiB"
        engine = srv.engine
        assert not engine._streams and engine.num_queued_requests == 0
        assert not engine._engine.request_ids() and not engine._engine.scheduler.has_unfinished_requests()
    finally:
        srv.stop()
