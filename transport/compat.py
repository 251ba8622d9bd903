"""Checks every KV connector makes before it moves a byte: the pool matches its descriptor, a
peer's handshake matches this instance's layout, a read names valid blocks.

A handshake is a JSON-serialisable dict; the fields every connector writes::

    {"version": 1, "connector": "nixl", "agent_name": "...", "num_blocks": 4096,
     "block_bytes": 262144, "compat_hash": "3f2a...", ...connector-specific fields}

``compat_hash`` comes from ``tandem.interfaces.compat_hash`` over the model, dtype, layer count,
KV heads, head size and block size; two instances may exchange blocks only when it is equal.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from tandem.interfaces import KVPoolDescriptor

HANDSHAKE_VERSION = 1
MAX_PEER_BLOCKS = 1 << 22
"""The most blocks a peer may advertise: a connector prepares one descriptor per peer block, so
the count bounds what ``add_peer`` allocates before it has read a byte."""
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
    return {
        "version": HANDSHAKE_VERSION,
        "connector": connector,
        "agent_name": agent_name,
        "num_blocks": descriptor.num_blocks,
        "block_bytes": descriptor.block_bytes,
        "device": descriptor.device,
        "compat_hash": descriptor.compat_hash,
    }


def check_handshake(local: dict[str, Any], remote: dict[str, Any]) -> None:
    """Raise ``KVHandshakeError`` unless ``remote``'s blocks can be read into ``local``'s pool:
    the same version, connector, parallel sizes and layout, and a pool of sane size (checked
    before anything is allocated for it)."""
    peer = remote.get("agent_name")
    if not isinstance(peer, str) or not 0 < len(peer) <= 256:
        raise KVHandshakeError("a KV peer handshake's agent_name must be a string of 1 to 256 characters")
    for key in ("version", "connector"):
        if remote.get(key) != local[key]:
            raise KVHandshakeError(
                f"KV peer {peer!r} speaks {key} {remote.get(key)!r}, this instance "
                f"{local[key]!r}: both instances must run the same tandem with the same kv_connector"
            )
    sizes = [(h.get("tensor_parallel_size", 1), h.get("pipeline_parallel_size", 1)) for h in (remote, local)]
    if sizes[0] != sizes[1]:
        raise KVHandshakeError(
            f"KV peer {peer!r} runs tensor_parallel_size × pipeline_parallel_size = "
            f"{sizes[0][0]} × {sizes[0][1]}, this instance {sizes[1][0]} × {sizes[1][1]}: prefill and "
            f"decode instances must be split alike")
    if remote.get("compat_hash") != local["compat_hash"] or remote.get("block_bytes") != local["block_bytes"]:
        raise KVHandshakeError(
            f"KV layout mismatch with peer {peer!r}: compat_hash {remote.get('compat_hash')!r} and "
            f"{remote.get('block_bytes')} bytes per block there, {local['compat_hash']!r} and "
            f"{local['block_bytes']} here; prefill and decode instances must serve the same model "
            f"with the same dtype, layer count, KV heads, head size, block size and parallel sizes"
        )
    num_blocks = remote.get("num_blocks")
    if (type(num_blocks) is not int or not 1 <= num_blocks <= MAX_PEER_BLOCKS
            or num_blocks * local["block_bytes"] > MAX_PEER_POOL_BYTES):
        raise KVHandshakeError(
            f"KV peer {peer!r} advertises a pool of {num_blocks!r} blocks of {local['block_bytes']} "
            f"bytes; a pool holds 1 to {MAX_PEER_BLOCKS} blocks and at most {MAX_PEER_POOL_BYTES} bytes")


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
