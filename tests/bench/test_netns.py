"""Test hosts (tandem.bench.netns, tests/helpers/netns.py): network namespaces that reach each
other over a veth bridge, in a subnet nothing else on this machine uses, with their own
loopback, and gone afterwards — also when the test body raises. Without root, a skip that says
why."""
from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys

import pytest

from tandem.bench import netns
from tests.helpers.netns import test_hosts

ECHO_SERVER = """
import socket, sys
with socket.create_server((sys.argv[1], int(sys.argv[2]))) as server:
    print("listening", flush=True)
    for _ in range(int(sys.argv[3])):
        conn, _ = server.accept()
        with conn:
            conn.sendall(b"from " + sys.argv[1].encode() + b": " + conn.recv(100))
"""

CLIENT = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5) as conn:
    conn.sendall(sys.argv[3].encode())
    print(conn.recv(100).decode())
"""


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=True).stdout


def _networks_in_use() -> list[ipaddress.IPv4Network]:
    """Read independently of netns: every IPv4 route of this namespace (main table), as networks."""
    return [ipaddress.ip_network(line.split()[0], strict=False)
            for line in _ip("-4", "route", "show").splitlines() if not line.startswith("default")]


def _leftovers(net: netns.TestHosts) -> list[str]:
    namespaces = [n for n in _ip("netns", "list").split() if n.startswith(f"tandem-{net.id}-")]
    links = [line for line in _ip("-o", "link", "show").splitlines() if net.id in line]
    return namespaces + links


@pytest.mark.timeout(60)
def test_hosts_reach_each_other_and_the_bridge_in_a_subnet_of_their_own():
    before = _networks_in_use()
    with test_hosts(2) as net:
        h1, h2 = net
        assert net.subnet.prefixlen == 24 and not any(net.subnet.overlaps(n) for n in before)
        addresses = [net.bridge_address, h1.address, h2.address]
        assert len(set(addresses)) == 3 and all(ipaddress.ip_address(a) in net.subnet for a in addresses)
        assert h1.namespace in _ip("netns", "list") and f"inet {h1.address}/24" in _ip(
            "-n", h1.namespace, "addr", "show", netns.HOST_DEVICE)
        server = h1.popen([sys.executable, "-c", ECHO_SERVER, h1.address, "7000", "2"],
                          stdout=subprocess.PIPE, text=True)
        assert server.stdout.readline() == "listening\n"
        from_h2 = h2.run([sys.executable, "-c", CLIENT, h1.address, "7000", "h2"], capture_output=True,
                         text=True, timeout=20)
        assert from_h2.stdout == f"from {h1.address}: h2\n", from_h2.stderr
        with socket.create_connection((h1.address, 7000), timeout=5) as conn:  # from this namespace
            conn.sendall(b"root")
            assert conn.recv(100) == f"from {h1.address}: root".encode()
        assert server.wait(10) == 0


@pytest.mark.timeout(60)
def test_each_host_has_its_own_loopback():
    with socket.create_server(("127.0.0.1", 0)) as here, test_hosts(1) as net:
        port = here.getsockname()[1]
        probe = net[0].run([sys.executable, "-c", CLIENT, "127.0.0.1", str(port), "x"],
                           capture_output=True, text=True, timeout=20)
        assert probe.returncode != 0 and "ConnectionRefusedError" in probe.stderr


@pytest.mark.timeout(60)
def test_everything_is_torn_down_when_the_body_raises():
    with pytest.raises(RuntimeError, match="the test failed"):
        with test_hosts(3) as net:
            sleeper = net[0].popen(["sleep", "600"])
            stray = subprocess.Popen(net[1].command(["sleep", "600"]))  # not started through popen
            assert len(_leftovers(net)) == 3 + 1 + 3  # namespaces, the bridge, the veths
            raise RuntimeError("the test failed")
    assert sleeper.wait(10) == -9 and stray.wait(10) == -9
    assert _leftovers(net) == []
    net.close()  # twice is harmless


def test_without_root_the_hosts_are_refused_with_the_reason(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(netns.HostsUnavailable, match="needs root"):
        netns.TestHosts(2).open()
    with pytest.raises(pytest.skip.Exception, match="cannot be made here: .*needs root"):
        with test_hosts(2):
            pytest.fail("the body ran without hosts")


def test_a_subnet_is_drawn_clear_of_every_network_in_use():
    used = [ipaddress.ip_network("10.0.0.0/9")]  # all of 10.0-127.x.y
    for _ in range(50):
        subnet = netns._free_subnet(used)
        assert subnet.prefixlen == 24 and subnet.subnet_of(ipaddress.ip_network("10.128.0.0/9"))
    with pytest.raises(netns.HostsUnavailable, match="no free"):
        netns._free_subnet([ipaddress.ip_network("10.0.0.0/8")])
