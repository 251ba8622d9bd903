"""Which network interface gloo binds to when the ranks span several hosts.

Gloo takes the interface from ``GLOO_SOCKET_IFNAME`` or, without it, from this host's hostname:
where the hostname resolves to 127.0.0.1 (the usual ``/etc/hosts`` of a container or a network
namespace) it binds to the loopback and advertises 127.0.0.1 to the other hosts, which then
connect to themselves ("Connection refused, remote=[127.0.0.1]:..."). With several hosts every
rank reaches the rendezvous address, so the interface holding the local address of that route
is one the others can reach: ``choose_gloo_interface`` names it, unless the user already has.
"""
from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct

logger = logging.getLogger("tandem")

GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def choose_gloo_interface(master_addr: str) -> str | None:
    """Set ``GLOO_SOCKET_IFNAME`` (in this process, before gloo reads it) to the interface this
    host reaches ``master_addr`` from, unless it is set; returns the interface gloo will use
    (None: gloo's own choice from the hostname, when no interface could be found)."""
    if os.environ.get(GLOO_SOCKET_IFNAME):
        return os.environ[GLOO_SOCKET_IFNAME]
    name = interface_towards(master_addr)
    if name is not None:
        os.environ[GLOO_SOCKET_IFNAME] = name
        logger.info("gloo binds to %s, the interface that reaches %s (set %s to choose another)",
                    name, master_addr, GLOO_SOCKET_IFNAME)
    return name


def interface_towards(address: str) -> str | None:
    """The name of the interface holding the local IPv4 address of this host's route to
    ``address`` (IPv4 or a name), or None where that cannot be told (no route, not Linux)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))  # a UDP connect picks the route and sends nothing
            local = probe.getsockname()[0]
            for _, name in socket.if_nameindex():
                try:
                    answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
                except OSError:  # an interface without an IPv4 address
                    continue
                if socket.inet_ntoa(answer[20:24]) == local:
                    return name
    except OSError:
        return None
    return None
