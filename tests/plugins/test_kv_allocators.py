"""The built-in KV allocator plugin."""
from importlib.metadata import entry_points

import pluggy

import tandem.hookspecs
from tandem.interfaces import KVAllocator
from tandem.plugins import kv_allocators
from tandem.sched.kv_manager import PagedKVAllocator


def test_the_hook_registers_the_paged_allocator():
    pm = pluggy.PluginManager("tandem")
    pm.add_hookspecs(tandem.hookspecs)
    pm.register(kv_allocators)
    found = {}
    pm.hook.tandem_register_kv_allocators(register=lambda name, cls: found.setdefault(name, cls))
    assert found == {"paged": PagedKVAllocator}
    assert issubclass(PagedKVAllocator, KVAllocator) and PagedKVAllocator.name == "paged"


def test_the_registered_class_builds_from_the_documented_arguments():
    kv = PagedKVAllocator(8, 16, False)
    assert (kv.num_usable_blocks, kv.block_size, kv.enable_prefix_caching) == (7, 16, False)


def test_the_module_is_a_tandem_entry_point():
    assert "tandem.plugins.kv_allocators" in {ep.value for ep in entry_points(group="tandem")}
