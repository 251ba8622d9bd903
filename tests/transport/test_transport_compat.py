"""compat_hash, KVPoolDescriptor.for_pool and the checks every connector makes before a transfer."""
from __future__ import annotations

import pytest
import torch

from tandem.interfaces import KVPoolDescriptor, compat_hash
from tandem.transport.compat import (
    MAX_PEER_BLOCKS,
    KVHandshakeError,
    base_handshake,
    check_handshake,
    check_pool,
)

FIELDS = dict(model="/models/llama", dtype="float32", num_layers=8, num_kv_heads=4, head_dim=64,
              block_size=16)


def test_compat_hash_ignores_keyword_order():
    assert compat_hash(**FIELDS) == compat_hash(**dict(reversed(list(FIELDS.items()))))


@pytest.mark.parametrize("field, other", [
    ("model", "/models/qwen"), ("dtype", "bfloat16"), ("num_layers", 9), ("num_kv_heads", 8),
    ("head_dim", 128), ("block_size", 32),
])
def test_compat_hash_changes_with_every_field(field, other):
    assert compat_hash(**FIELDS) != compat_hash(**{**FIELDS, field: other})


def test_descriptor_of_a_block_major_pool():
    # [num_blocks, layers, K/V, block_size, kv_heads, head_dim] float32:
    # one block is 2 * 2 * 16 * 4 * 8 * 4 bytes = 8192 bytes.
    pool = torch.zeros(5, 2, 2, 16, 4, 8)
    descriptor = KVPoolDescriptor.for_pool(pool, "h")
    assert (descriptor.num_blocks, descriptor.block_bytes, descriptor.device) == (5, 8192, "cpu")
    for block_id in range(5):
        assert pool[block_id].data_ptr() == descriptor.base_address + block_id * 8192


def test_descriptor_refuses_a_strided_view():
    with pytest.raises(ValueError, match="contiguous"):
        KVPoolDescriptor.for_pool(torch.zeros(4, 2, 8)[:, 0], "h")


def test_check_pool_refuses_a_wrong_size():
    pool = torch.zeros(4, 16)
    wrong = KVPoolDescriptor(pool.data_ptr(), num_blocks=4, block_bytes=32, device="cpu", compat_hash="h")
    with pytest.raises(ValueError, match="not 4 blocks of 32 bytes"):
        check_pool(pool, wrong)


def handshake(compat: str, block_bytes: int = 8192, **overrides) -> dict:
    descriptor = KVPoolDescriptor(0x1000, 4, block_bytes, "cpu", compat)
    return base_handshake("nixl", "agent", descriptor) | overrides


def test_matching_handshakes_pass():
    check_handshake(handshake("abc"), handshake("abc"))


def test_compat_mismatch_names_both_hashes():
    with pytest.raises(KVHandshakeError, match="'abc'.*'xyz'|'xyz'.*'abc'"):
        check_handshake(handshake("abc"), handshake("xyz"))


def test_block_size_mismatch_is_refused():
    with pytest.raises(KVHandshakeError, match="4096 bytes per block there"):
        check_handshake(handshake("abc"), handshake("abc", block_bytes=4096))


@pytest.mark.parametrize("field, value", [("version", 99), ("connector", "loopback")])
def test_other_protocols_are_refused(field, value):
    with pytest.raises(KVHandshakeError, match=field):
        check_handshake(handshake("abc"), handshake("abc", **{field: value}))


@pytest.mark.parametrize("num_blocks", [2**31, MAX_PEER_BLOCKS + 1, 0, -1, "4", 4.0, True, None])
def test_a_peer_pool_of_no_sane_size_is_refused(num_blocks):
    """The count of blocks a peer claims is bounded before anything is made for it."""
    with pytest.raises(KVHandshakeError, match="advertises a pool of"):
        check_handshake(handshake("abc"), handshake("abc", num_blocks=num_blocks))


def test_the_largest_sane_peer_pool_passes():
    check_handshake(handshake("abc", block_bytes=4096),
                    handshake("abc", block_bytes=4096, num_blocks=MAX_PEER_BLOCKS))


@pytest.mark.parametrize("agent_name", [None, 7, "", "a" * 257])
def test_a_peer_without_a_proper_agent_name_is_refused(agent_name):
    with pytest.raises(KVHandshakeError, match="agent_name"):
        check_handshake(handshake("abc"), handshake("abc", agent_name=agent_name))
