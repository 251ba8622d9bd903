"""Real peer processes for the NIXL connector tests: an owner serving a KV pool of seeded random
contents, and a reader reading from an owner without end (to be killed).

Both run in ``multiprocessing`` spawn children and talk to the test through a pipe::

    owner → test   its handshake_info() dict, first
    test → owner   ("blocks", ids)         → the owner's own bytes of those blocks (numpy), the oracle
                                            (a rank of a tp-way owner: its heads of them)
                   ("notifications",)      → every transfer id notified so far
                   ("stop",)               → closes the connector and exits
    reader → test  "reading", once its first read is done; then it keeps reading
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import time
from dataclasses import dataclass

import torch

from tandem.interfaces import KVPoolDescriptor, KVShard, compat_hash
from tandem.transport.nixl import NixlConnector

COMPAT = compat_hash(model="tests/transport", dtype="float32", num_layers=2, num_kv_heads=2,
                     head_dim=32, block_size=16)


@dataclass(frozen=True, slots=True)
class Layout:
    """``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` float32."""

    num_blocks: int = 64
    num_layers: int = 2
    block_size: int = 16
    num_kv_heads: int = 2
    head_dim: int = 32

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)


SMALL = Layout()
LARGE = Layout(num_blocks=256, num_layers=8, num_kv_heads=4, head_dim=64)  # 256 KiB blocks


def head_shards(layout: Layout, tp: int) -> list[KVShard]:
    """The shards of a tp-way split of ``layout``'s KV heads (tp divides them)."""
    per = layout.num_kv_heads // tp
    return [KVShard(0, layout.num_layers, r * per, (r + 1) * per, layout.block_size, layout.head_dim, 4)
            for r in range(tp)]


def make_connector(pool: torch.Tensor, compat: str = COMPAT, shards=None, rank: int = 0) -> NixlConnector:
    connector = NixlConnector()
    connector.register_pool(pool, KVPoolDescriptor.for_pool(pool, compat, shards, rank))
    return connector


def serve_pool(conn, layout: Layout, seed: int, env: dict[str, str], tp: int = 1, rank: int = 0,
               stderr_path: str | None = None) -> None:
    """Rank ``rank`` of a tp-way owner: its heads of the seeded whole pool. With ``stderr_path``
    its file descriptor 2 (where UCX writes why it aborts a process) goes to that file."""
    if stderr_path is not None:
        with open(stderr_path, "ab") as log:
            os.dup2(log.fileno(), 2)
    os.environ.update(env)
    shards = head_shards(layout, tp)
    mine = shards[rank]
    whole = torch.randn(layout.shape, generator=torch.Generator().manual_seed(seed))
    pool = whole[:, :, :, :, mine.head_start:mine.head_stop].contiguous()
    connector = make_connector(pool, shards=shards, rank=rank)
    conn.send(connector.handshake_info())
    notified: list[str] = []
    while True:
        notified.extend(connector.get_notifications())
        if not conn.poll(0.01):
            continue
        command, *args = conn.recv()
        if command == "blocks":
            conn.send(pool[args[0]].numpy())
        elif command == "notifications":
            conn.send(list(notified))
        elif command == "stop":
            connector.close()
            return


def read_forever(conn, handshake: dict, layout: Layout, env: dict[str, str]) -> None:
    os.environ.update(env)
    connector = make_connector(torch.zeros(layout.shape))
    peer = connector.add_peer(handshake)
    half = layout.num_blocks // 2
    for n in range(1_000_000):
        connector.start_read(f"r{n}", peer, list(range(half)), list(range(half, 2 * half)), 30.0)
        while not connector.poll():
            pass
        if n == 0:
            conn.send("reading")


class PeerProcess:
    """A spawned peer and the test's end of its pipe."""

    def __init__(self, target, *args) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=target, args=(child_conn, *args), daemon=True)
        self.process.start()

    def receive(self, timeout_s: float = 60.0):
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"peer process {self.process.pid} sent nothing in {timeout_s} s")
        return self.conn.recv()

    def ask(self, *command):
        self.conn.send(command)
        return self.receive()

    def wait_notification(self, transfer_id: str, timeout_s: float = 5.0) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            notified = self.ask("notifications")
            if transfer_id in notified:
                return notified
            time.sleep(0.02)
        raise TimeoutError(f"the owner never saw {transfer_id!r}")

    def freeze(self, timeout_s: float = 5.0) -> None:
        """SIGSTOP the peer and wait until the kernel shows it stopped (delivery is asynchronous)."""
        os.kill(self.process.pid, signal.SIGSTOP)
        deadline = time.monotonic() + timeout_s
        while _proc_state(self.process.pid) != "T":
            if time.monotonic() > deadline:
                raise TimeoutError(f"peer process {self.process.pid} did not stop")
            time.sleep(0.001)

    def thaw(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)


def _proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


def start_owner(layout: Layout = SMALL, seed: int = 0, env: dict[str, str] | None = None, tp: int = 1,
                rank: int = 0, stderr_path: str | None = None) -> tuple[PeerProcess, dict]:
    owner = PeerProcess(serve_pool, layout, seed, env or {}, tp, rank, stderr_path)
    return owner, owner.receive()


def wait_outcomes(connector: NixlConnector, transfer_ids, timeout_s: float) -> dict[str, str]:
    """Poll until every transfer id is reported; fail the test past ``timeout_s``."""
    wanted, outcomes = set(transfer_ids), {}
    deadline = time.monotonic() + timeout_s
    while wanted - outcomes.keys():
        if time.monotonic() > deadline:
            raise TimeoutError(f"unreported after {timeout_s} s: {sorted(wanted - outcomes.keys())}")
        outcomes.update(connector.poll())
        time.sleep(0.001)
    return outcomes
