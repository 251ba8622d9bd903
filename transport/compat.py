"""Checks every KV connector makes before it moves a byte: the pool matches its descriptor, a
peer's handshake matches this instance's layout, a read names valid blocks.

A handshake is a JSON-serialisable dict; the fields every connector writes::

    {"version": 1, "connector": "nixl", "agent_name": "...", "num_blocks": 4096,
     "block_bytes": 262144, "compat_hash": "3f2a...", "shard": [0, 8, 0, 4, 16, 64, 4],
     ...connector-specific fields}

``compat_hash`` comes from ``tandem.interfaces.compat_hash`` over the model, dtype, layer count,
KV heads, head size and block size; two instances may exchange blocks only when it is equal.
``shard`` (``KVShard.to_json``) says which layers and KV heads the pool holds; an instance of
several ranks serves them all under ``ranks``, so that a peer split another way (other tensor or
pipeline parallel sizes) reads each of its ranks' layers and heads where they are
(``read_plan``, ``tandem.transport.shard_plan``).
"""
from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from tandem.interfaces import KVPoolDescriptor, KVShard
from tandem.transport.shard_plan import MAX_RANKS, RankPlan, RemoteRead, ShardPlanError, plan_rank

HANDSHAKE_VERSION = 1
MAX_PEER_BLOCKS = 1 << 22
"""The most blocks a peer may advertise: the count bounds the pool a peer claims (and what a
connector may prepare for it) before a byte has been read."""
MAX_PEER_POOL_BYTES = 1 << 44
"""The largest pool a peer may advertise (16 TiB, beyond any one device's memory)."""


class KVHandshakeError(ValueError):
    """A peer whose blocks this instance cannot use (other layout, model or dtype, other
    connector or handshake version); raised by ``add_peer``, before any transfer."""


def check_pool(pool: Any, descriptor: KVPoolDescriptor) -> None:
    """``pool`` is one contiguous tensor whose address and size are ``descriptor``'s."""
    if not pool.is_contiguous():
        raise ValueError("the KV pool must be one contiguous tensor")
    if pool.data_ptr() != descriptor.base_address:
        raise ValueError(
            f"descriptor base address {descriptor.base_address:#x} is not the pool's "
            f"{pool.data_ptr():#x}"
        )
    nbytes = pool.numel() * pool.element_size()
    if descriptor.num_blocks < 1 or nbytes != descriptor.num_blocks * descriptor.block_bytes:
        raise ValueError(
            f"the pool holds {nbytes} bytes, not {descriptor.num_blocks} blocks of "
            f"{descriptor.block_bytes} bytes"
        )
    if str(pool.device) != descriptor.device:
        raise ValueError(f"the pool is on {pool.device}, the descriptor says {descriptor.device}")


def base_handshake(connector: str, agent_name: str, descriptor: KVPoolDescriptor) -> dict[str, Any]:
    """The handshake fields every connector shares."""
    shard = descriptor.shard
    return {
        "version": HANDSHAKE_VERSION,
        "connector": connector,
        "agent_name": agent_name,
        "num_blocks": descriptor.num_blocks,
        "block_bytes": descriptor.block_bytes,
        "device": descriptor.device,
        "compat_hash": descriptor.compat_hash,
        "shard": shard.to_json() if shard is not None else None,
    }


def check_handshake(local: dict[str, Any], remote: dict[str, Any]) -> None:
    """Raise ``KVHandshakeError`` unless ``remote`` (one rank's handshake) comes from a peer whose
    blocks this instance may read: the same version, connector and compat hash, a pool of sane
    size (checked before anything is allocated for it) whose blocks its shard describes. Which
    bytes are read is ``read_plan``'s to say."""
    peer = remote.get("agent_name")
    if not isinstance(peer, str) or not 0 < len(peer) <= 256:
        raise KVHandshakeError("a KV peer handshake's agent_name must be a string of 1 to 256 characters")
    for key in ("version", "connector"):
        if remote.get(key) != local[key]:
            raise KVHandshakeError(
                f"KV peer {peer!r} speaks {key} {remote.get(key)!r}, this instance "
                f"{local[key]!r}: both instances must run the same tandem with the same kv_connector"
            )
    if remote.get("compat_hash") != local["compat_hash"]:
        raise KVHandshakeError(
            f"KV layout mismatch with peer {peer!r}: compat_hash {remote.get('compat_hash')!r} there, "
            f"{local['compat_hash']!r} here; prefill and decode instances must serve the same model "
            f"with the same dtype, layer count, KV heads, head size and block size")
    block_bytes = remote.get("block_bytes")
    shard = _shard(peer, remote)
    if type(block_bytes) is not int or block_bytes != (shard.block_bytes if shard else local["block_bytes"]):
        raise KVHandshakeError(
            f"KV layout mismatch with peer {peer!r}: {block_bytes} bytes per block there, "
            f"{local['block_bytes']} here, and no KV shard that explains them")
    num_blocks = remote.get("num_blocks")
    if (type(num_blocks) is not int or not 1 <= num_blocks <= MAX_PEER_BLOCKS
            or num_blocks * block_bytes > MAX_PEER_POOL_BYTES):
        raise KVHandshakeError(
            f"KV peer {peer!r} advertises a pool of {num_blocks!r} blocks of {block_bytes} "
            f"bytes; a pool holds 1 to {MAX_PEER_BLOCKS} blocks and at most {MAX_PEER_POOL_BYTES} bytes")


def peer_ranks(local: dict[str, Any], remote: dict[str, Any]) -> list[dict[str, Any]]:
    """The handshakes of every rank of the instance that produced ``remote`` (its "ranks", a
    tensor- or pipeline-parallel instance's; else ``remote`` alone), each checked by
    ``check_handshake``."""
    ranks = remote.get("ranks", [remote])
    if not (isinstance(ranks, list) and 1 <= len(ranks) <= MAX_RANKS
            and all(isinstance(r, dict) for r in ranks)):
        raise KVHandshakeError(f"a KV peer handshake's ranks must be a list of 1 to {MAX_RANKS} handshakes")
    for rank in ranks:
        check_handshake(local, rank)
    return ranks


def read_plan(descriptor: KVPoolDescriptor, ranks: list[dict[str, Any]]) -> RankPlan:
    """What this rank (``descriptor``'s) reads of the peer whose checked rank handshakes are
    ``ranks`` (``tandem.transport.shard_plan``). Pools of no known layout read whole blocks of a
    one-rank peer alike. Raises ``KVHandshakeError`` with the reason a split cannot work."""
    remote = [KVShard.from_json(r["shard"]) if r.get("shard") is not None else None for r in ranks]
    if descriptor.shards and None not in remote:
        try:
            return plan_rank(list(descriptor.shards), descriptor.rank, remote)
        except ShardPlanError as exc:
            raise KVHandshakeError(f"KV peer {ranks[0]['agent_name']!r}: {exc}") from None
    if len(ranks) != 1 or len(descriptor.shards) > 1 or ranks[0]["block_bytes"] != descriptor.block_bytes:
        raise KVHandshakeError(
            f"KV peer {ranks[0]['agent_name']!r} has {len(ranks)} ranks of {ranks[0]['block_bytes']} bytes "
            f"per block, this instance {max(len(descriptor.shards), 1)} of {descriptor.block_bytes}, and "
            "one of them does not say which layers and KV heads its pool holds")
    return RankPlan((RemoteRead(0, np.zeros((1, 2), dtype=np.int64), descriptor.block_bytes),), {0: 1})


def _shard(peer: str, handshake: dict[str, Any]) -> KVShard | None:
    value = handshake.get("shard")
    if value is None:
        return None
    try:
        return KVShard.from_json(value)
    except ValueError as exc:
        raise KVHandshakeError(f"KV peer {peer!r}: {exc}") from None


def check_read(
    transfer_id: str,
    remote_block_ids: Sequence[int],
    local_block_ids: Sequence[int],
    remote_num_blocks: int | None,
    local_num_blocks: int,
    in_flight: Collection[str],
) -> None:
    """Raise ``ValueError`` for a malformed read (``remote_num_blocks`` None: peer unknown, its
    ids are checked when it is known)."""
    if transfer_id in in_flight:
        raise ValueError(f"transfer {transfer_id!r} is already in flight")
    if len(remote_block_ids) != len(local_block_ids):
        raise ValueError(
            f"transfer {transfer_id!r}: {len(remote_block_ids)} remote blocks but "
            f"{len(local_block_ids)} local blocks"
        )
    if len(set(local_block_ids)) != len(local_block_ids):
        raise ValueError(f"transfer {transfer_id!r}: a local block appears twice")
    _check_range(transfer_id, "local", local_block_ids, local_num_blocks)
    if remote_num_blocks is not None:
        _check_range(transfer_id, "remote", remote_block_ids, remote_num_blocks)


def _check_range(transfer_id: str, side: str, block_ids: Sequence[int], num_blocks: int) -> None:
    bad = [b for b in block_ids if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(
            f"transfer {transfer_id!r}: {side} block ids {bad[:5]} out of range [0, {num_blocks})"
        )
