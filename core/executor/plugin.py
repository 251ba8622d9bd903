"""Registers tandem's built-in executors (entry point ``builtin_executors``)."""
from __future__ import annotations

import tandem
from tandem.executor.mp import MultiprocExecutor
from tandem.executor.uniproc import UniprocExecutor
from tandem.hookspecs import Register


@tandem.hookimpl
def tandem_register_executors(register: Register) -> None:
    register("uniproc", UniprocExecutor)
    register("mp", MultiprocExecutor)
