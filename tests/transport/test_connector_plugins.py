"""The built-in connectors are registered through the plugin hook; NIXL is imported only on use."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tandem.plugin_manager import get_registry
from tandem.transport.loopback import LoopbackConnector
from tandem.transport.nixl import NixlConnector


def test_builtin_connectors_are_registered():
    registry = get_registry()
    assert registry.get("kv_connector", "nixl") is NixlConnector
    assert registry.get("kv_connector", "loopback") is LoopbackConnector


@pytest.mark.timeout(120)
def test_listing_and_building_connectors_does_not_import_nixl():
    code = ("import sys; from tandem.plugin_manager import get_registry; "
            "[get_registry().get('kv_connector', n)() for n in ('nixl', 'loopback')]; "
            "print(sorted(m for m in sys.modules if m.split('.')[0].startswith('nixl')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
