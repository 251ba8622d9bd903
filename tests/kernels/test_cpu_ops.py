"""tandem.kernels.cpu_ops wraps every operator the C++ library defines (kernels/cpu/*.cpp), each
with a docstring, and is the one module that names ``torch.ops.tandem_cpu``."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

from tandem.kernels import cpu_ops

REPO = Path(__file__).resolve().parents[2]
SCHEMA = re.compile(r'm\.def\("(\w+)\((.*)\) -> ')


def defined_ops() -> dict[str, list[str]]:
    """Each operator's argument names (defaults dropped), read from its ``m.def`` schema in the
    C++ sources."""
    ops = {}
    for source in (REPO / "kernels" / "cpu").glob("*.cpp"):
        text = re.sub(r'"\s*\n\s*"', "", source.read_text())  # join schemas split over lines
        for name, args in SCHEMA.findall(text):
            ops[name] = [arg.split()[-1].split("=")[0] for arg in args.split(",") if arg.strip()]
    return ops


def test_every_operator_has_a_documented_wrapper_with_its_arguments():
    ops = defined_ops()
    assert len(ops) == 26 and set(cpu_ops.OPS) == set(ops)
    for name, args in ops.items():
        wrapper = getattr(cpu_ops, name)
        assert list(inspect.signature(wrapper).parameters) == args, name
        assert wrapper.__doc__ and len(wrapper.__doc__) > 80, f"{name} has no contract"


def test_only_cpu_ops_names_the_library():
    users = [path.relative_to(REPO) for folder in ("core", "plugins", "quant", "transport", "kernels")
             for path in (REPO / folder).rglob("*.py") if "torch.ops.tandem_cpu" in path.read_text()]
    assert users == [Path("kernels/cpu_ops.py")]


def test_the_linear_build_follows_the_linear_sources_only(tmp_path, monkeypatch):
    """The tuner's cache key (``linear_build``) changes with a linear kernel's source and not
    with an attention kernel's: editing paged_attention.cpp keeps the measured choices."""
    copies = []
    for path in cpu_ops.SOURCES:
        copy = tmp_path / path.name
        copy.write_bytes(path.read_bytes())
        copies.append(copy)

    def build_with(edited: str | None) -> str:
        if edited is not None:
            (tmp_path / edited).write_bytes((tmp_path / edited).read_bytes() + b"\n// edited\n")
        monkeypatch.setattr(cpu_ops, "SOURCES", copies)
        cpu_ops.linear_build.cache_clear()
        try:
            return cpu_ops.linear_build()
        finally:
            cpu_ops.linear_build.cache_clear()

    before = build_with(None)
    assert build_with("paged_attention.cpp") == before
    assert build_with("sampling.cpp") == before
    assert build_with("linear_dpbf16.cpp") != before
