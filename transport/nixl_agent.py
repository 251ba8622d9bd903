"""A NIXL agent (UCX backend) over NIXL's bindings, with a progress thread that sleeps.

NIXL's Python wrapper (``nixl._api.nixl_agent``) hard-codes a progress-thread delay of 0: its UCX
progress thread then polls without sleeping and takes a whole core per agent, idle or not.
Built from the bindings with a delay, the thread sleeps in ``poll()`` on the UCX worker's event
fd, wakes on traffic, and wakes every ``progress_delay_us`` besides (NIXL's own safety net,
almost free when idle). Only the calls the connector needs are
wrapped; a transfer request and a prepared descriptor list are plain integer handles.
"""
from __future__ import annotations

import ctypes
import logging
import os
import sys
from typing import Any

import numpy as np


def _bindings() -> Any:
    """NIXL's bindings, imported on first use so that tandem works without NIXL installed."""
    try:
        from nixl import _bindings
    except ImportError:
        try:
            from nixl_cu12 import _bindings
        except ImportError as exc:
            raise ImportError(
                "the 'nixl' KV connector needs NIXL: pip install nixl-cu12==1.5.1 after torch, then "
                "pip install --no-deps nixl==1.5.1"
            ) from exc
    if "NIXL_LOG_LEVEL" not in os.environ:
        # NIXL's Python package logs at INFO on stdout, which is the server's and the CLI's.
        logging.getLogger("nixl").setLevel(logging.WARNING)
    return _bindings


_HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25


def back_with_huge_pages(address: int, nbytes: int) -> bool:
    """Move the whole 2 MiB pages of host memory ``[address, address + nbytes)`` onto transparent
    huge pages now (``madvise`` MADV_HUGEPAGE, then MADV_COLLAPSE, Linux 6.1+), contents kept.

    A same-host read (UCX's cma transport, ``process_vm_readv``) pins the owner's pages one by one,
    so fewer, larger pages make it several times faster (docs/benchmarks.md). Returns False,
    changing nothing that matters, where the kernel refuses."""
    if not sys.platform.startswith("linux"):
        return False
    start = -(-address // _HUGE_PAGE_BYTES) * _HUGE_PAGE_BYTES
    end = (address + nbytes) // _HUGE_PAGE_BYTES * _HUGE_PAGE_BYTES
    if end <= start:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for advice in (_MADV_HUGEPAGE, _MADV_COLLAPSE):
        if libc.madvise(start, end - start, advice) != 0:
            logging.getLogger("tandem.transport").debug(
                "madvise(%d) refused: %s", advice, os.strerror(ctypes.get_errno()))
            return False
    return True


class NixlAgent:
    """One NIXL agent named ``name`` with one UCX backend and a sleeping progress thread."""

    def __init__(self, name: str, progress_delay_us: int = 1000) -> None:
        nb = _bindings()
        config = nb.nixlAgentConfig()
        config.useProgThread = True
        config.useListenThread = False
        config.syncMode = nb.NIXL_THREAD_SYNC_NONE
        config.pthrDelay = progress_delay_us
        config.captureTelemetry = False
        self._nb = nb
        self._agent = nb.nixlAgent(name, config)
        self._agent.createBackend("UCX", {})
        self.peer_errors: tuple[type[Exception], ...] = (nb.nixlRemoteDisconnectError,
                                                          nb.nixlNotFoundError)
        """Exceptions that mean the remote agent died, disconnected or is unknown."""

    def _segment(self, mem_type: str) -> Any:
        return {"DRAM": self._nb.DRAM_SEG, "VRAM": self._nb.VRAM_SEG}[mem_type]

    def register(self, address: int, nbytes: int, device_id: int, mem_type: str) -> Any:
        """Register one memory region with the backend; returns what ``deregister`` takes."""
        descs = self._nb.nixlRegDList(self._segment(mem_type), [(address, nbytes, device_id, "")])
        self._agent.registerMem(descs)
        return descs

    def deregister(self, registration: Any) -> None:
        self._agent.deregisterMem(registration)

    def metadata(self) -> bytes:
        """What a peer passes to ``load_peer`` (connection info and registered memory)."""
        return self._agent.getLocalMD()

    def load_peer(self, metadata: bytes) -> str:
        """Add a remote agent from its metadata; returns its name."""
        name = self._agent.loadRemoteMD(metadata)
        return name.decode() if isinstance(name, bytes) else name

    def drop_peer(self, name: str) -> None:
        self._agent.invalidateRemoteMD(name)

    def create_read(self, local_descs: np.ndarray, local_mem_type: str, remote_agent: str,
                    remote_descs: np.ndarray, remote_mem_type: str, notification: bytes) -> int:
        """A READ of the remote agent's ``remote_descs[i] = (address, length, device)`` into this
        agent's ``local_descs[i]``; the remote agent receives ``notification`` once the data has
        arrived. Returns the request handle, which ``release`` must free whatever becomes of it."""
        local = self._nb.nixlXferDList(self._segment(local_mem_type), local_descs)
        remote = self._nb.nixlXferDList(self._segment(remote_mem_type), remote_descs)
        return self._agent.createXferReq(self._nb.NIXL_READ, local, remote, remote_agent, notification)

    def post(self, request: int) -> None:
        """Start the request; raises one of ``peer_errors`` when the peer is gone. Between two
        processes of one host (UCX's cma transport) the data moves inside this call."""
        self._agent.postXferReq(request)

    def state(self, request: int) -> str:
        """The request's state, "DONE", "PROC" or "ERR"; raises one of ``peer_errors`` when the
        peer is gone."""
        status = self._agent.getXferStatus(request)
        if status == self._nb.NIXL_SUCCESS:
            return "DONE"
        return "PROC" if status == self._nb.NIXL_IN_PROG else "ERR"

    def release(self, request: int) -> None:
        """Free a request, cancelling it when still in progress; raises when it cannot."""
        self._agent.releaseXferReq(request)

    def notifications(self) -> list[bytes]:
        """Notification messages received since the last call, from every peer."""
        received = self._agent.getNotifs({})
        return [message for messages in received.values() for message in messages]

    def notify(self, peer: str, message: bytes) -> None:
        self._agent.genNotif(peer, message)
