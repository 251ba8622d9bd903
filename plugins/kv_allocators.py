"""Built-in KV allocators, registered through the same hook a third-party package uses."""
from __future__ import annotations

from collections.abc import Callable

import tandem
from tandem.sched.kv_manager import PagedKVAllocator


@tandem.hookimpl
def tandem_register_kv_allocators(register: Callable[[str, type], None]) -> None:
    register("paged", PagedKVAllocator)
