"""tandem.plugin_manager: entry-point loading, TANDEM_DISABLE_PLUGINS, the registry and its errors,
and the example out-of-tree plugin tandem-spf found through its entry point.

Every test runs in a sandbox: every installed entry point is disabled (the built-in plugins have
their own tests; tandem-spf is enabled where a test needs it), a fake distribution registers
stand-ins for the default names "fcfs" and "paged", and test distributions are written to a
temporary folder on sys.path.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import subprocess
import sys
import textwrap
import types
from collections.abc import Sequence
from pathlib import Path

import pytest

import tandem
from tandem.config import ConfigError, load_config
from tandem.interfaces import AttentionBackend, KVAllocator, SchedulingPolicy
from tandem.plugin_manager import (
    PluginEntry,
    PluginError,
    UnknownPluginError,
    disabled_plugins,
    get_plugin_manager,
    get_registry,
    reset_plugins,
)

FAKE_BUILTINS = '''
import tandem
from tandem import interfaces


def _stand_in(base):
    """A concrete subclass of base whose methods do nothing: only its name matters here."""
    methods = {name: lambda self, *args, **kwargs: None for name in base.__abstractmethods__}
    return type("StandIn" + base.__name__, (base,), methods)


@tandem.hookimpl
def tandem_register_schedulers(register):
    register("fcfs", _stand_in(interfaces.SchedulingPolicy))


@tandem.hookimpl
def tandem_register_kv_allocators(register):
    register("paged", _stand_in(interfaces.KVAllocator))


@tandem.hookimpl
def tandem_register_structured_output_backends(register):
    register("xgrammar", _stand_in(interfaces.StructuredOutputBackend))
'''


class PluginSandbox:
    """Installs fake distributions (dist-info + modules) in a folder on sys.path and sets
    TANDEM_DISABLE_PLUGINS; forgets the loaded plugins before and after each test."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = root
        self.monkeypatch = monkeypatch
        self.modules: list[str] = []
        self.disabled = [ep.name for ep in importlib.metadata.entry_points(group="tandem")]
        monkeypatch.syspath_prepend(str(root))
        self.disable()
        self.add_dist("tandem-fake-builtins", {"fake_builtins": "tandem_fake_builtins"},
                      {"tandem_fake_builtins": FAKE_BUILTINS})
        reset_plugins()

    def add_dist(self, project: str, entry_points: dict[str, str],
                 modules: dict[str, str] | None = None) -> None:
        dist_info = self.root / f"{project.replace('-', '_')}-0.1.dist-info"
        dist_info.mkdir()
        (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project}\nVersion: 0.1\n")
        lines = "".join(f"{name} = {value}\n" for name, value in entry_points.items())
        (dist_info / "entry_points.txt").write_text(f"[tandem]\n{lines}")
        for module, source in (modules or {}).items():
            (self.root / f"{module}.py").write_text(textwrap.dedent(source))
            self.modules.append(module)
        importlib.invalidate_caches()

    def disable(self, *names: str) -> None:
        self.disabled += names
        self.monkeypatch.setenv("TANDEM_DISABLE_PLUGINS", ",".join(self.disabled))

    def enable(self, name: str) -> None:
        self.disabled.remove(name)
        self.disable()

    def close(self) -> None:
        reset_plugins()
        for module in self.modules:
            sys.modules.pop(module, None)


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    root = tmp_path / "site"
    root.mkdir()
    box = PluginSandbox(root, monkeypatch)
    yield box
    box.close()


@pytest.fixture
def spf_installed(sandbox):
    try:
        importlib.metadata.distribution("tandem-spf")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("the example plugin is not installed: "
                    "pip install --no-deps -e examples/plugins/tandem-spf")
    sandbox.enable("spf")


def plugin(hook: str, function) -> types.SimpleNamespace:
    """A plugin object implementing ``hook`` with ``function``."""
    return types.SimpleNamespace(**{hook: tandem.hookimpl(function)})


def spf_config(tmp_path: Path) -> Path:
    path = tmp_path / "spf.toml"
    path.write_text('[engine]\nscheduler = "spf"\n')
    return path


class FIFO(SchedulingPolicy):
    def sort_key(self, request):
        return request.arrival_time

    def select_victim(self, running: Sequence):
        return running[-1]


# --------------------------------------------------------------------------- the example plugin


def test_spf_is_found_through_its_entry_point_with_its_package(spf_installed):
    from tandem_spf.policy import ShortestPromptFirstPolicy

    scheduler_entries = [e for e in get_registry().entries() if e.kind == "scheduler"]
    assert scheduler_entries[1] == PluginEntry("scheduler", "spf", ShortestPromptFirstPolicy,
                                               "tandem-spf")
    assert scheduler_entries[0].name == "fcfs"
    assert scheduler_entries[0].package == "tandem-fake-builtins"
    assert get_registry().get("scheduler", "spf") is ShortestPromptFirstPolicy


def test_config_selecting_spf_validates(spf_installed, tmp_path):
    assert load_config(spf_config(tmp_path), env={}).engine.scheduler == "spf"


def test_disabling_spf_makes_that_config_fail_naming_the_allowed_values(spf_installed, sandbox,
                                                                         tmp_path):
    sandbox.disable("spf")
    with pytest.raises(ConfigError) as info:
        load_config(spf_config(tmp_path), env={})
    assert "engine.scheduler: no scheduler named 'spf'; allowed: 'fcfs'" in str(info.value)


def test_a_second_plugin_registering_spf_is_an_error_naming_both_packages(spf_installed):
    get_plugin_manager().register(
        plugin("tandem_register_schedulers", lambda register: register("spf", FIFO)),
        name="acme-scheduling",
    )
    with pytest.raises(PluginError) as info:
        get_registry()
    message = str(info.value)
    assert "scheduler 'spf' is registered twice" in message
    assert "by tandem-spf (tandem_spf.policy.ShortestPromptFirstPolicy)" in message
    assert f"by acme-scheduling ({FIFO.__module__}.FIFO)" in message


# --------------------------------------------------------------------------- entry-point loading


def test_a_plugin_module_that_fails_to_import_is_named(sandbox):
    sandbox.add_dist("tandem-broken", {"broken": "tandem_no_such_module"})
    with pytest.raises(PluginError, match=r"entry point 'broken' = 'tandem_no_such_module' of "
                                          r"tandem-broken failed to import: ModuleNotFoundError"):
        get_plugin_manager()


def test_a_plugin_module_that_raises_on_import_is_named(sandbox):
    sandbox.add_dist("tandem-raises", {"raises": "tandem_raises"},
                     {"tandem_raises": "raise RuntimeError('boom')\n"})
    with pytest.raises(PluginError, match=r"'raises' .* tandem-raises failed to import: RuntimeError: boom"):
        get_plugin_manager()


def test_disabled_plugins_are_not_even_imported(sandbox):
    sandbox.add_dist("tandem-raises", {"raises": "tandem_raises"},
                     {"tandem_raises": "raise RuntimeError('boom')\n"})
    sandbox.disable("raises")
    assert get_plugin_manager().is_blocked("raises")
    assert "tandem_raises" not in sys.modules
    assert get_registry().names("kv_allocator") == ["paged"]


def test_a_misspelt_hook_is_named_with_its_plugin(sandbox):
    sandbox.add_dist("tandem-typo", {"typo": "tandem_typo"}, {"tandem_typo": """
        import tandem

        @tandem.hookimpl
        def tandem_register_scheduler(register):
            pass
    """})
    with pytest.raises(PluginError, match=r"plugin 'typo' \(tandem-typo\).*tandem_register_scheduler"):
        get_plugin_manager()


def test_two_distributions_with_one_entry_point_name_are_an_error(sandbox):
    module = {"tandem_empty": "x = 1\n"}
    sandbox.add_dist("tandem-one", {"same": "tandem_empty"}, module)
    sandbox.add_dist("tandem-two", {"same": "tandem_empty"})
    with pytest.raises(PluginError, match=r"entry point 'same'.*tandem-(one|two) and tandem-(two|one)"):
        get_plugin_manager()


def test_disabled_plugins_parses_the_comma_separated_list():
    assert disabled_plugins({"TANDEM_DISABLE_PLUGINS": " spf, ,builtin_attention ,"}) == [
        "spf", "builtin_attention"]
    assert disabled_plugins({}) == []


# --------------------------------------------------------------------------- registration checks


@pytest.mark.parametrize("hook, base", [
    ("tandem_register_schedulers", "SchedulingPolicy"),
    ("tandem_register_kv_allocators", "KVAllocator"),
    ("tandem_register_attention_backends", "AttentionBackend"),
    ("tandem_register_quant_methods", "QuantMethod"),
    ("tandem_register_kv_connectors", "KVConnector"),
    ("tandem_register_routing_policies", "RoutingPolicy"),
])
def test_a_class_outside_its_kinds_abc_is_rejected(sandbox, hook, base):
    class NotAComponent:
        pass

    get_plugin_manager().register(plugin(hook, lambda register: register("odd", NotAComponent)),
                                  name="odd-plugin")
    with pytest.raises(PluginError) as info:
        get_registry()
    assert str(info.value).startswith(f"plugin 'odd-plugin', hook {hook}: register('odd', ")
    assert str(info.value).endswith(f"NotAComponent does not subclass tandem.interfaces.{base}")


def test_a_model_may_be_any_class(sandbox):
    class TinyForCausalLM:
        pass

    get_plugin_manager().register(
        plugin("tandem_register_models", lambda register: register("TinyForCausalLM", TinyForCausalLM)),
        name="tiny-models",
    )
    assert get_registry().get("model", "TinyForCausalLM") is TinyForCausalLM


def test_an_abstract_class_is_rejected(sandbox):
    class Incomplete(SchedulingPolicy):
        def sort_key(self, request):
            return 0

    get_plugin_manager().register(
        plugin("tandem_register_schedulers", lambda register: register("half", Incomplete)),
        name="half-plugin",
    )
    with pytest.raises(PluginError, match="leaves abstract methods unimplemented: select_victim"):
        get_registry()


@pytest.mark.parametrize("hook, name, base", [
    ("tandem_register_attention_backends", "auto", AttentionBackend),
    ("tandem_register_quant_methods", "none", None),
    ("tandem_register_kv_allocators", "", KVAllocator),
])
def test_reserved_and_empty_names_are_rejected(sandbox, hook, name, base):
    get_plugin_manager().register(plugin(hook, lambda register: register(name, base or FIFO)),
                                  name="greedy-names")
    with pytest.raises(PluginError, match="reserved|non-empty"):
        get_registry()


def test_a_registration_hook_that_raises_is_named(sandbox):
    def explode(register):
        raise ValueError("cannot find libfoo")

    get_plugin_manager().register(plugin("tandem_register_kv_allocators", explode), name="foo-kv")
    with pytest.raises(PluginError, match=r"plugin 'foo-kv', hook tandem_register_kv_allocators "
                                          r"raised ValueError: cannot find libfoo"):
        get_registry()


def test_a_registration_wrapper_is_rejected(sandbox):
    def wrapper(register):
        yield

    get_plugin_manager().register(
        types.SimpleNamespace(tandem_register_schedulers=tandem.hookimpl(wrapper=True)(wrapper)),
        name="wrapping",
    )
    with pytest.raises(PluginError, match="cannot be wrappers"):
        get_registry()


# --------------------------------------------------------------------------- registry API


def test_get_lists_installed_names_for_an_unknown_name(sandbox):
    get_plugin_manager().register(
        plugin("tandem_register_schedulers", lambda register: register("fifo", FIFO)), name="fifo")
    registry = get_registry()
    assert registry.names("scheduler") == ["fcfs", "fifo"]
    with pytest.raises(UnknownPluginError, match=r"no scheduler plugin named 'lifo'; installed: fcfs, fifo"):
        registry.get("scheduler", "lifo")
    with pytest.raises(ValueError, match="unknown plugin kind 'schedulers'"):
        registry.names("schedulers")


def test_entries_are_ordered_by_kind_then_name(sandbox):
    get_plugin_manager().register(
        plugin("tandem_register_schedulers", lambda register: (register("b", FIFO), register("a", FIFO))),
        name="two",
    )
    assert [(e.kind, e.name, e.package) for e in get_registry().entries()] == [
        ("scheduler", "a", "two"), ("scheduler", "b", "two"), ("scheduler", "fcfs", "tandem-fake-builtins"),
        ("kv_allocator", "paged", "tandem-fake-builtins"),
        ("structured_output_backend", "xgrammar", "tandem-fake-builtins"),
    ]


def test_loading_happens_once_per_process_until_reset(sandbox):
    pm, registry = get_plugin_manager(), get_registry()
    assert get_plugin_manager() is pm and get_registry() is registry
    reset_plugins()
    assert get_plugin_manager() is not pm


def test_importing_tandem_loads_no_plugin():
    code = ("import sys, tandem, tandem.config, tandem.plugin_manager, tandem.cli; "
            "print(any(m == 'tandem_spf' or m.startswith('tandem.plugins.') for m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "False", result.stderr


def test_observer_hooks_are_called_by_keyword(sandbox):
    seen = []
    observer = types.SimpleNamespace(
        tandem_engine_started=tandem.hookimpl(lambda config: seen.append(("started", config))),
        tandem_request_finished=tandem.hookimpl(
            lambda request_id, finish_reason: seen.append((request_id, finish_reason))),
    )
    hook = get_plugin_manager().hook
    get_plugin_manager().register(observer, name="observer")
    hook.tandem_engine_started(config="the-config")
    hook.tandem_request_finished(request_id="r1", finish_reason="stop", num_prompt_tokens=3,
                                 num_output_tokens=4)
    assert seen == [("started", "the-config"), ("r1", "stop")]
