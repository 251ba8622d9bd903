"""docs/plugins.md documents every hook of tandem.hookspecs, and its examples are valid: the
Python examples compile, and each plugin example registers through a real plugin manager (which
checks its classes against the interfaces); the TOML examples parse."""
from __future__ import annotations

import inspect
import re
import tomllib
import types
from pathlib import Path

import pytest

from tandem import hookspecs
from tandem.plugin_manager import TandemPluginManager, build_registry

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"
TEXT = GUIDE.read_text()


def hookspec_signatures() -> dict[str, list[str]]:
    """Every function of tandem.hookspecs marked as a hookspec, with its argument names."""
    return {
        name: list(inspect.signature(function).parameters)
        for name, function in vars(hookspecs).items()
        if callable(function) and hasattr(function, "tandem_spec")
    }


def documented_hooks() -> dict[str, list[str]]:
    """The ``## tandem_xxx(arg, ...)`` headings of the guide."""
    return {
        match.group(1): [a.strip() for a in match.group(2).split(",") if a.strip()]
        for match in re.finditer(r"^## (tandem_\w+)\((.*)\)\s*$", TEXT, re.MULTILINE)
    }


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", TEXT, re.MULTILINE | re.DOTALL)


def test_the_hookspecs_module_has_hooks():
    assert "tandem_register_schedulers" in hookspec_signatures()
    assert len(hookspec_signatures()) >= 9


@pytest.mark.parametrize("hook", sorted(hookspec_signatures()))
def test_every_hook_has_a_section_headed_by_its_signature(hook):
    documented = documented_hooks()
    assert hook in documented, f"docs/plugins.md has no '## {hook}(...)' section"
    assert documented[hook] == hookspec_signatures()[hook], f"the heading of {hook} has stale arguments"


def test_no_section_documents_a_hook_that_does_not_exist():
    assert set(documented_hooks()) <= set(hookspec_signatures())


def test_the_guide_covers_packaging_selection_disabling_and_duplicates():
    for topic in ["[project.entry-points.tandem]", "TANDEM_DISABLE_PLUGINS", "registered twice",
                  'scheduler = "spf"', "tandem plugins"]:
        assert topic in TEXT, topic


@pytest.mark.parametrize("index", range(len(code_blocks("python"))))
def test_python_examples_compile(index):
    compile(code_blocks("python")[index], f"docs/plugins.md python block {index}", "exec")


@pytest.mark.parametrize("index", [i for i, block in enumerate(code_blocks("python"))
                                   if "@tandem.hookimpl" in block])
def test_plugin_examples_register_valid_components(index):
    namespace: dict = {}
    exec(compile(code_blocks("python")[index], f"docs/plugins.md python block {index}", "exec"),
         namespace)
    module = types.ModuleType(f"docs_example_{index}")
    module.__dict__.update(namespace)
    pm = TandemPluginManager()
    pm.register(module, name=module.__name__)
    pm.check_pending()
    build_registry(pm)


@pytest.mark.parametrize("index", range(len(code_blocks("toml"))))
def test_toml_examples_parse(index):
    tomllib.loads(code_blocks("toml")[index])
