"""The "faulty" connector over the loopback one, each fault at rate 1: what it reports, what it
does to the blocks, and the owner that restarts with a new agent. Oracle: the owner's tensor and
the block checksums' definition (tests/transport/test_kv_checksum.py)."""
from __future__ import annotations

import time

import pytest
import torch

from tandem.config import load_config
from tandem.interfaces import KVConnector, KVPoolDescriptor, compat_hash
from tandem.plugin_manager import get_registry
from tandem.transport.faulty import FaultyConnector

pytestmark = pytest.mark.timeout(30)

SHAPE = (16, 2, 2, 4, 2, 8)
COMPAT = compat_hash(model="m", dtype="float32", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)


def faulty(pool: torch.Tensor, **faults) -> FaultyConnector:
    config = load_config(overrides={"fault_injection.inner_connector": "loopback",
                                    **{f"fault_injection.{k}": v for k, v in faults.items()}}, env={})
    connector = get_registry().get("kv_connector", "faulty")()
    connector.configure(config)
    connector.register_pool(pool, KVPoolDescriptor.for_pool(pool, COMPAT))
    return connector


@pytest.fixture
def owner_pool() -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))


def read(reader: FaultyConnector, owner: FaultyConnector, transfer_id: str, deadline_s: float = 5.0,
         wait_s: float = 5.0) -> list[str]:
    """Read owner block 3 into reader block 5; the states reported until one is final."""
    peer = reader.add_peer(owner.handshake_info())
    reader.start_read(transfer_id, peer, [3], [5], deadline_s)
    states, end = [], time.monotonic() + wait_s
    while time.monotonic() < end and (not states or states[-1] == "error:deadline"):
        states += reader.poll().values()
        time.sleep(0.01)
    return states


def test_a_failed_read_is_reported_as_one_after_it_ran(owner_pool):
    owner, reader_pool = faulty(owner_pool), torch.zeros(SHAPE)
    reader = faulty(reader_pool, read_fail_rate=1.0)
    assert read(reader, owner, "t") == ["error:transfer"]
    assert reader.event_counts() == {"read_fail": 1}


def test_a_truncated_read_is_done_but_its_checksum_differs(owner_pool):
    owner, reader_pool = faulty(owner_pool), torch.zeros(SHAPE)
    reader = faulty(reader_pool, truncate_rate=1.0)
    assert read(reader, owner, "t") == ["done"]
    half = reader_pool[5].numel() // 2
    assert torch.equal(reader_pool[5].flatten()[:half], owner_pool[3].flatten()[:half])
    assert not torch.equal(reader_pool[5].flatten()[half:], owner_pool[3].flatten()[half:])
    assert reader.block_checksums([5]) != owner.block_checksums([3])
    assert reader.event_counts() == {"truncate": 1}


def test_a_delayed_read_is_reported_late_and_past_its_deadline_closed(owner_pool):
    owner, reader_pool = faulty(owner_pool), torch.zeros(SHAPE)
    reader = faulty(reader_pool, read_delay_rate=1.0, read_delay_s=0.3)
    start = time.monotonic()
    assert read(reader, owner, "slow", deadline_s=5.0) == ["done"]
    late = faulty(torch.zeros(SHAPE), read_delay_rate=1.0, read_delay_s=0.3, seed=1)
    assert read(late, owner, "late", deadline_s=0.0) == ["error:deadline", "closed"]
    assert time.monotonic() - start > 0.0
    assert reader.event_counts() == {"read_delay": 1} and late.event_counts() == {"read_late": 1}


def test_dropped_and_delayed_notifications(owner_pool):
    dropping = faulty(owner_pool, notify_drop_rate=1.0)
    reader = faulty(torch.zeros(SHAPE))
    assert read(reader, dropping, "lost") == ["done"]
    assert dropping.get_notifications() == []
    delaying = faulty(owner_pool.clone(), notify_delay_rate=1.0, notify_delay_s=0.2)
    assert read(reader, delaying, "held") == ["done"]
    assert delaying.get_notifications() == []
    time.sleep(0.25)
    assert delaying.get_notifications() == ["held"]
    assert dropping.event_counts() == {"notify_drop": 1} and delaying.event_counts() == {"notify_delay": 1}


def test_an_owner_restarts_with_a_new_agent_on_the_same_pool(owner_pool):
    owner, reader_pool = faulty(owner_pool, restart_every_n=1), torch.zeros(SHAPE)
    reader = faulty(reader_pool)
    before = owner.handshake_info()
    assert read(reader, owner, "first") == ["done"]
    assert owner.get_notifications() == ["first"]  # the first notification: then the restart
    after = owner.handshake_info()
    assert after["agent_name"] != before["agent_name"] and owner.event_counts() == {"restart": 1}
    peer = reader.add_peer(before)  # a reader's stale handshake: the old agent is gone
    reader.start_read("stale", peer, [3], [6], 5.0)
    assert reader.poll() == {"stale": "error:peer"}
    reader_pool.zero_()
    assert read(reader, owner, "fresh") == ["done"]
    assert torch.equal(reader_pool[5], owner_pool[3])


def test_every_method_of_the_interface_is_forwarded():
    """An optional ``KVConnector`` method the wrapper did not define would silently run the
    interface's default instead of the inner connector's."""
    methods = {name for name, value in vars(KVConnector).items() if callable(value) and not name.startswith("_")}
    assert sorted(methods - set(vars(FaultyConnector))) == []
