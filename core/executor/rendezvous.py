"""The rendezvous store of an mp launch: rank 0 hosts torch.distributed's TCPStore on
``parallel.master_addr`` (that address only: a store torch opens itself listens on every
interface), the other ranks connect to it.
"""
from __future__ import annotations

import errno
import logging
import socket
from datetime import timedelta
from typing import Any

logger = logging.getLogger("tandem")


def open_store(master_addr: str, master_port: int, is_head: bool, timeout: timedelta) -> Any:
    """The store at ``master_addr:master_port``: hosted here when ``is_head``, else a client that
    waits up to ``timeout`` for it."""
    import torch.distributed as dist

    if not is_head:
        return dist.TCPStore(master_addr, master_port, None, False, timeout)
    listener = listen_socket(master_addr, master_port)
    return dist.TCPStore(master_addr, master_port, None, True, timeout, wait_for_workers=False,
                         master_listen_fd=listener.detach())  # the store owns the socket from here


def listen_socket(address: str, port: int) -> socket.socket:
    """A listening TCP socket on ``address:port``; on every interface where ``address`` is not
    one of this host's (the head is reached through a NAT or a forwarded port)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    try:
        return socket.create_server(sockaddr[:2], family=family, backlog=128)
    except OSError as exc:
        if exc.errno != errno.EADDRNOTAVAIL:
            raise
    logger.info("parallel.master_addr = %s is not an address of this host: the rendezvous listens on "
                "port %d of every interface", address, port)
    if socket.has_dualstack_ipv6():
        return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=128)
    return socket.create_server(("", port), backlog=128)
