"""gloo's interface across hosts: the one holding the local address of the route to the
rendezvous address, unless GLOO_SOCKET_IFNAME already names one."""
from __future__ import annotations

import os
import sys

import pytest

from tandem.executor.netif import GLOO_SOCKET_IFNAME, choose_gloo_interface, interface_towards

linux = pytest.mark.skipif(sys.platform != "linux", reason="interfaces are looked up with Linux ioctls")


@linux
def test_the_loopback_address_is_reached_from_lo():
    assert interface_towards("127.0.0.1") == "lo"


@linux
def test_the_chosen_interface_is_set_for_gloo(monkeypatch):
    monkeypatch.setenv(GLOO_SOCKET_IFNAME, "")  # recorded: undone after the test
    monkeypatch.delenv(GLOO_SOCKET_IFNAME)
    assert choose_gloo_interface("127.0.0.1") == "lo"
    assert os.environ[GLOO_SOCKET_IFNAME] == "lo"


def test_an_interface_the_user_named_is_kept(monkeypatch):
    monkeypatch.setenv(GLOO_SOCKET_IFNAME, "eth7")
    assert choose_gloo_interface("127.0.0.1") == "eth7"


def test_no_interface_for_an_address_without_a_route():
    assert interface_towards("no-such-host.invalid") is None
