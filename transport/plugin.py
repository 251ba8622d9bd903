"""Registers the built-in KV connectors: "nixl" (NIXL over UCX; NIXL is imported only when a pool
is registered, so listing plugins works without it), "loopback" (in-process, for tests) and
"faulty" (another connector with injected faults, for tests and chaos runs)."""
from __future__ import annotations

import tandem
from tandem.hookspecs import Register
from tandem.transport.faulty import FaultyConnector
from tandem.transport.loopback import LoopbackConnector
from tandem.transport.nixl import NixlConnector


@tandem.hookimpl
def tandem_register_kv_connectors(register: Register) -> None:
    register("nixl", NixlConnector)
    register("loopback", LoopbackConnector)
    register("faulty", FaultyConnector)
