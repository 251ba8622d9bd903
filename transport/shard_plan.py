"""Which bytes of which peer rank each rank of a reading instance reads, when the two instances
split the model's KV differently (other tensor or pipeline parallel sizes).

Each rank's pool is block-major (``tandem.interfaces.KVShard``): one block of a rank holding
layers ``[l0, l1)`` and KV heads ``[h0, h1)`` of the model is, in elements::

    [l1 - l0 layers][2: K, V][block_size tokens][h1 - h0 heads][head_dim]

A reading rank needs every (layer, head) of its shard from one remote rank that holds it. The
remote ranks' shards tile the model's layers × heads, except that ranks holding a replicated head
(fewer KV heads than tensor ranks) hold the same rectangle: of those the reader takes
``holders[reader_rank % len(holders)]``, which spreads the readers of one head over its copies.
For each remote rank chosen, the overlap of the two rectangles — layers ``[a, b)``, heads ``[c, d)``
— is, within a block, one run of ``(d - c) * head_dim`` elements per (layer, K/V, token), at
byte offsets (``rH``, ``lH``: the remote and local shards' head counts; ``E``: bytes of one head,
``head_dim * itemsize``)::

    i = ((l - a) * 2 + kv) * block_size + t        for l in [a, b), kv in {0, 1}, t < block_size
    remote offset = (((a - rl0) * 2 * block_size + i) * rH + (c - rh0)) * E
    local offset  = (((a - ll0) * 2 * block_size + i) * lH + (c - lh0)) * E

When both shards hold exactly the heads ``[c, d)`` the runs are contiguous on both sides and
merge into one run per block (a whole block when the layers agree too: the plan of instances
split alike is one descriptor per block, as before).

Worked case (tests/transport/test_shard_plan.py): 2 layers, block_size 2, 4 heads of 1 float32
element, a remote rank holding every head and a local rank holding heads [2, 4) → 2 * 2 * 2 = 8
runs of 8 bytes per block, remote offsets 8, 24, 40, ... (16 * i + 8), local offsets 8 * i.

Notifications: the owner frees a transfer's blocks once each of its ranks has heard from every
reader that reads from it. ``RankPlan.notify`` names, for this reading rank, each remote rank it
must notify and how many notifications that remote rank expects in all (its readers, or one
designated reader, ``remote_rank % len(local_shards)``, for a remote rank nobody reads from).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tandem.interfaces import KVShard

MAX_RANKS = 1024
"""The most ranks an instance may advertise in a handshake."""


class ShardPlanError(ValueError):
    """The two instances' shards cannot give a reading rank its KV (another head size, block
    size or element size, or layers and heads that no remote rank holds)."""


@dataclass(frozen=True, slots=True)
class RemoteRead:
    """What one reading rank reads of one remote rank, per block: byte runs
    ``segments[i] = (local offset, remote offset)`` of ``run_bytes`` each."""

    remote_rank: int
    segments: np.ndarray
    run_bytes: int

    @property
    def bytes_per_block(self) -> int:
        return len(self.segments) * self.run_bytes


@dataclass(frozen=True, slots=True)
class RankPlan:
    """One reading rank's plan: its reads, and ``notify`` (remote rank → notifications that rank
    expects for one transfer; this rank sends one of them)."""

    reads: tuple[RemoteRead, ...]
    notify: dict[int, int]

    @property
    def descriptors_per_block(self) -> int:
        return sum(len(r.segments) for r in self.reads)

    @property
    def bytes_per_block(self) -> int:
        return sum(r.bytes_per_block for r in self.reads)


def plan_rank(local: list[KVShard], rank: int, remote: list[KVShard]) -> RankPlan:
    """The plan of local rank ``rank`` of an instance whose ranks hold ``local``, reading from an
    instance whose ranks hold ``remote``. Raises ``ShardPlanError``."""
    if not 1 <= len(remote) <= MAX_RANKS:
        raise ShardPlanError(f"a KV peer of {len(remote)} ranks (1 to {MAX_RANKS})")
    choices = [_choose(local, r, remote) for r in range(len(local))]
    readers: dict[int, list[int]] = {}
    for r, chosen in enumerate(choices):
        for p in chosen:
            readers.setdefault(p, []).append(r)
    notify = {p: len(readers[p]) for p in choices[rank]}
    for p in range(len(remote)):
        if p not in readers and p % len(local) == rank:
            notify[p] = 1
    reads = tuple(_read(local[rank], p, remote[p]) for p in choices[rank])
    return RankPlan(reads, notify)


def transfer_descs(base_address: int, block_bytes: int, block_ids: list[int], offsets: np.ndarray,
                   run_bytes: int, device_id: int) -> np.ndarray:
    """NIXL descriptors ``(address, length, device)`` of runs at ``offsets`` within each of
    ``block_ids``, block by block."""
    blocks = np.asarray(block_ids, dtype=np.uint64) * np.uint64(block_bytes) + np.uint64(base_address)
    descs = np.empty((len(block_ids) * len(offsets), 3), dtype=np.uint64)
    descs[:, 0] = (blocks[:, None] + offsets.astype(np.uint64)[None, :]).reshape(-1)
    descs[:, 1] = run_bytes
    descs[:, 2] = device_id
    return descs


def _choose(local: list[KVShard], rank: int, remote: list[KVShard]) -> list[int]:
    """The remote ranks local rank ``rank`` reads from, checked to cover its shard once."""
    mine = local[rank]
    holders: dict[tuple[int, int, int, int], list[int]] = {}
    for p, theirs in enumerate(remote):
        _check_alike(mine, theirs, p)
        if _overlap(mine, theirs) is not None:
            holders.setdefault((theirs.layer_start, theirs.layer_stop, theirs.head_start,
                                theirs.head_stop), []).append(p)
    covered, rects = 0, list(holders)
    for i, (la, lb, ha, hb) in enumerate(rects):
        if any(la < lb2 and la2 < lb and ha < hb2 and ha2 < hb for la2, lb2, ha2, hb2 in rects[:i]):
            raise ShardPlanError("the KV peer's ranks hold overlapping but different layers and heads")
        covered += (min(lb, mine.layer_stop) - max(la, mine.layer_start)) * (
            min(hb, mine.head_stop) - max(ha, mine.head_start))
    if covered != mine.num_layers * mine.num_heads:
        raise ShardPlanError(
            f"the KV peer's ranks do not hold every layer and KV head of rank {rank}'s shard (layers "
            f"[{mine.layer_start}, {mine.layer_stop}), KV heads [{mine.head_start}, {mine.head_stop})): "
            "the two instances serve different models")
    return sorted(ps[rank % len(ps)] for ps in holders.values())


def _check_alike(mine: KVShard, theirs: KVShard, p: int) -> None:
    for what in ("block_size", "head_dim", "itemsize"):
        if getattr(mine, what) != getattr(theirs, what):
            raise ShardPlanError(f"KV peer rank {p} has {what} {getattr(theirs, what)}, this instance "
                                 f"{getattr(mine, what)}: its blocks cannot be read here")


def _overlap(a: KVShard, b: KVShard) -> tuple[int, int, int, int] | None:
    layers = max(a.layer_start, b.layer_start), min(a.layer_stop, b.layer_stop)
    heads = max(a.head_start, b.head_start), min(a.head_stop, b.head_stop)
    if layers[0] >= layers[1] or heads[0] >= heads[1]:
        return None
    return (*layers, *heads)


def _read(mine: KVShard, p: int, theirs: KVShard) -> RemoteRead:
    a, b, c, d = _overlap(mine, theirs)
    head_bytes = mine.head_dim * mine.itemsize
    run_bytes = (d - c) * head_bytes
    rows = (b - a) * 2 * mine.block_size
    if mine.num_heads == theirs.num_heads == d - c:  # contiguous on both sides: one run
        rows, run_bytes = 1, rows * run_bytes
    i = np.arange(rows, dtype=np.int64)
    remote = ((a - theirs.layer_start) * 2 * mine.block_size + i) * theirs.num_heads * head_bytes \
        + (c - theirs.head_start) * head_bytes
    local = ((a - mine.layer_start) * 2 * mine.block_size + i) * mine.num_heads * head_bytes \
        + (c - mine.head_start) * head_bytes
    return RemoteRead(p, np.stack([local, remote], axis=1), run_bytes)
