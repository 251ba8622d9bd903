"""Test hosts for the suite: ``tandem.bench.netns``'s network namespaces on a veth bridge, made
for one test and torn down after it, whatever the test's outcome.

Where they cannot be made (not root, no ``ip``, the kernel refuses), the test **skips** and the
skip reason says why: it never passes without having run.

    from tests.helpers.netns import test_hosts, two_hosts   # two_hosts: a fixture

    def test_across_hosts(two_hosts):
        server = two_hosts[0].popen([...,  "--host", two_hosts[0].address])
        ...  # every process started with Host.popen, and any other left in a host, is killed

    def test_four_hosts():
        with test_hosts(4) as net:   # net[i].address, net[i].popen(argv), net.bridge_address
            ...
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tandem.bench.netns import HOST_DEVICE, Host, HostsUnavailable, TestHosts

__all__ = ["HOST_DEVICE", "Host", "HostsUnavailable", "TestHosts", "skip_reason", "test_hosts", "two_hosts"]


def skip_reason(exc: HostsUnavailable) -> str:
    return f"test hosts (network namespaces on a veth bridge) cannot be made here: {exc}"


@contextmanager
def test_hosts(count: int) -> Iterator[TestHosts]:
    """``count`` test hosts for the ``with`` body, or ``pytest.skip`` naming why not."""
    try:
        net = TestHosts(count).open()
    except HostsUnavailable as exc:
        pytest.skip(skip_reason(exc))
    try:
        yield net
    finally:
        net.close()


test_hosts.__test__ = False  # a helper, not a test


@pytest.fixture
def two_hosts() -> Iterator[TestHosts]:
    with test_hosts(2) as net:
        yield net
