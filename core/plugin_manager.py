"""Loads tandem's plugins and builds the registry of named components.

Plugins are modules (or objects) with ``@tandem.hookimpl`` functions for the hooks of
``tandem.hookspecs``; installed packages list them as entry points of the ``tandem`` group.
Loading happens once per process, on the first ``get_plugin_manager()`` / ``get_registry()``
call, never as an import side effect::

    entry points of group "tandem"          TANDEM_DISABLE_PLUGINS=a,b blocks entry points a and b
      → PluginManager("tandem")             one pluggy manager, hookspecs added
      → Registry                            every registration hook called once, per plugin:
                                            (kind, name) → PluginEntry(kind, name, cls, package)

A plugin that fails to import, implements an unknown hook, registers a class that does not
subclass its kind's ABC, or registers a name another plugin already took is a ``PluginError``
naming the plugin, its package and the problem.
"""
from __future__ import annotations

import importlib.metadata
import inspect
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import pluggy

from tandem import hookspecs, interfaces

logger = logging.getLogger("tandem.plugins")

ENTRY_POINT_GROUP = "tandem"
DISABLE_ENV_VAR = "TANDEM_DISABLE_PLUGINS"


class PluginError(Exception):
    """A broken plugin: the message names the plugin, its package and the problem."""


class UnknownPluginError(ValueError):
    """A lookup of a name no installed plugin registered; the message lists the installed names."""


@dataclass(frozen=True, slots=True)
class PluginKind:
    """A kind of component: the hook that registers it and the ABC its classes subclass
    (None: any class)."""

    name: str
    hook: str
    base: type | None


KINDS: dict[str, PluginKind] = {
    kind.name: kind
    for kind in [
        PluginKind("scheduler", "tandem_register_schedulers", interfaces.SchedulingPolicy),
        PluginKind("kv_allocator", "tandem_register_kv_allocators", interfaces.KVAllocator),
        PluginKind("attention_backend", "tandem_register_attention_backends",
                   interfaces.AttentionBackend),
        PluginKind("quant_method", "tandem_register_quant_methods", interfaces.QuantMethod),
        PluginKind("kv_connector", "tandem_register_kv_connectors", interfaces.KVConnector),
        PluginKind("routing_policy", "tandem_register_routing_policies", interfaces.RoutingPolicy),
        PluginKind("model", "tandem_register_models", None),
        PluginKind("executor", "tandem_register_executors", interfaces.Executor),
        PluginKind("structured_output_backend", "tandem_register_structured_output_backends",
                   interfaces.StructuredOutputBackend),
        PluginKind("tool_parser", "tandem_register_tool_parsers", interfaces.ToolParser),
    ]
}

# Names the config gives a meaning of its own; no plugin may register them.
_RESERVED_NAMES = {"attention_backend": {"auto"}, "quant_method": {"auto", "none"}}


@dataclass(frozen=True, slots=True)
class PluginEntry:
    """One registered component: ``cls`` registered as ``name`` for ``kind`` by ``package``
    (the distribution of the entry point, or the plugin's name for a plugin registered in code)."""

    kind: str
    name: str
    cls: type
    package: str


class Registry:
    """The components every plugin registered, by kind and name. Built once per process."""

    def __init__(self) -> None:
        self._entries: dict[str, dict[str, PluginEntry]] = {kind: {} for kind in KINDS}

    def get(self, kind: str, name: str) -> type:
        """The class registered as ``name`` for ``kind``; raises ``UnknownPluginError`` listing
        the installed names."""
        entry = self._kind(kind).get(name)
        if entry is None:
            installed = ", ".join(self.names(kind)) or "none"
            raise UnknownPluginError(f"no {kind} plugin named {name!r}; installed: {installed}")
        return entry.cls

    def names(self, kind: str) -> list[str]:
        """The registered names of ``kind``, sorted."""
        return sorted(self._kind(kind))

    def entries(self) -> list[PluginEntry]:
        """Every registered component, by kind (in ``KINDS`` order) and name."""
        return [entries[name] for entries in self._entries.values() for name in sorted(entries)]

    def add(self, entry: PluginEntry) -> None:
        """Record ``entry``; ``PluginError`` when another plugin already registered its name."""
        previous = self._kind(entry.kind).get(entry.name)
        if previous is not None:
            raise PluginError(
                f"{entry.kind} {entry.name!r} is registered twice: by {previous.package} "
                f"({_qualname(previous.cls)}) and by {entry.package} ({_qualname(entry.cls)}); "
                f"uninstall one of them or disable it with {DISABLE_ENV_VAR}"
            )
        self._entries[entry.kind][entry.name] = entry

    def _kind(self, kind: str) -> dict[str, PluginEntry]:
        if kind not in self._entries:
            raise ValueError(f"unknown plugin kind {kind!r}; kinds: {', '.join(KINDS)}")
        return self._entries[kind]


class TandemPluginManager(pluggy.PluginManager):
    """pluggy's manager for project "tandem", with the hookspecs added, that remembers the
    distribution each entry-point plugin came from."""

    def __init__(self) -> None:
        super().__init__("tandem")
        self.add_hookspecs(hookspecs)
        self._packages: dict[str, str] = {}

    def load_entry_points(self, disabled: Iterable[str] = ()) -> None:
        """Register the plugin of every ``tandem`` entry point except the ``disabled`` names,
        then check that every hook implementation matches a hookspec."""
        for name in disabled:
            self.set_blocked(name)
        for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if self.is_blocked(entry_point.name):
                logger.info("plugin %r disabled by %s", entry_point.name, DISABLE_ENV_VAR)
                continue
            self._load_entry_point(entry_point)
        try:
            self.check_pending()
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"plugin {self.describe(exc.plugin)}: {exc}") from None

    def _load_entry_point(self, entry_point: importlib.metadata.EntryPoint) -> None:
        package = entry_point.dist.name if entry_point.dist else "an unknown distribution"
        if entry_point.name in self._packages:
            raise PluginError(
                f"two distributions define the tandem entry point {entry_point.name!r}: "
                f"{self._packages[entry_point.name]} and {package}"
            )
        where = f"entry point {entry_point.name!r} = {entry_point.value!r} of {package}"
        try:
            plugin = entry_point.load()
        except Exception as exc:
            problem = f"{type(exc).__name__}: {exc}"
            raise PluginError(f"plugin {where} failed to import: {problem}") from exc
        try:
            self.register(plugin, name=entry_point.name)
        except (pluggy.PluginValidationError, ValueError) as exc:
            raise PluginError(f"plugin {where} cannot be registered: {exc}") from None
        self._packages[entry_point.name] = package
        logger.debug("loaded plugin %s", where)

    def package_of(self, plugin: object) -> str:
        """The distribution an entry-point plugin came from, else the plugin's registered name."""
        name = self.get_name(plugin) or repr(plugin)
        return self._packages.get(name, name)

    def describe(self, plugin: object) -> str:
        """``'name' (package)`` of a registered plugin, for error messages."""
        name = self.get_name(plugin) or repr(plugin)
        package = self.package_of(plugin)
        return repr(name) if package == name else f"{name!r} ({package})"


def build_registry(pm: TandemPluginManager) -> Registry:
    """Call every registration hook of every plugin of ``pm`` once; collect what they register."""
    registry = Registry()
    for kind in KINDS.values():
        for impl in getattr(pm.hook, kind.hook).get_hookimpls():
            _run_registration_hook(pm, registry, kind, impl)
    return registry


def _run_registration_hook(
    pm: TandemPluginManager, registry: Registry, kind: PluginKind, impl: pluggy.HookImpl
) -> None:
    where = f"plugin {pm.describe(impl.plugin)}, hook {kind.hook}"
    if impl.hookwrapper or impl.wrapper:
        raise PluginError(f"{where}: registration hooks cannot be wrappers")
    package = pm.package_of(impl.plugin)

    def register(name: str, cls: type) -> None:
        problem = _registration_problem(kind, name, cls)
        if problem:
            raise PluginError(f"{where}: register({name!r}, {cls!r}): {problem}")
        registry.add(PluginEntry(kind.name, name, cls, package))

    arguments: dict[str, Callable[[str, type], None]] = {"register": register}
    try:
        impl.function(*[arguments[arg] for arg in impl.argnames])
    except PluginError:
        raise
    except Exception as exc:
        raise PluginError(f"{where} raised {type(exc).__name__}: {exc}") from exc


def _registration_problem(kind: PluginKind, name: Any, cls: Any) -> str | None:
    if not isinstance(name, str) or not name.strip() or name != name.strip():
        return "the name must be a non-empty string without surrounding spaces"
    if name in _RESERVED_NAMES.get(kind.name, ()):
        return f"{name!r} is reserved: the config uses it for {kind.name} with a meaning of its own"
    if not isinstance(cls, type):
        return "the second argument must be a class"
    if kind.base is not None and not issubclass(cls, kind.base):
        return f"{_qualname(cls)} does not subclass tandem.interfaces.{kind.base.__name__}"
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        return f"{_qualname(cls)} leaves abstract methods unimplemented: {missing}"
    return None


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


# --------------------------------------------------------------------------- the process's plugins

_lock = threading.RLock()
_plugin_manager: TandemPluginManager | None = None
_registry: Registry | None = None


def disabled_plugins(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The entry-point names listed in ``TANDEM_DISABLE_PLUGINS`` (comma-separated)."""
    return [name.strip() for name in environ.get(DISABLE_ENV_VAR, "").split(",") if name.strip()]


def get_plugin_manager() -> TandemPluginManager:
    """The process's plugin manager; loads the installed plugins on the first call."""
    global _plugin_manager
    with _lock:
        if _plugin_manager is None:
            pm = TandemPluginManager()
            pm.load_entry_points(disabled_plugins())
            _plugin_manager = pm
        return _plugin_manager


def call_observers(hook_name: str, **kwargs: Any) -> None:
    """Call every implementation of the observer hook ``hook_name`` with ``kwargs``, as pluggy
    would (each gets the arguments it names, last registered first), except that one that raises
    is logged and skipped: an observer never breaks the engine or the other observers."""
    for impl in reversed(getattr(get_plugin_manager().hook, hook_name).get_hookimpls()):
        try:
            impl.function(**{name: kwargs[name] for name in impl.argnames})
        except Exception:  # noqa: BLE001 - an observer's bug is logged, not propagated
            logger.exception("the %s hook of plugin %r raised; skipped", hook_name, impl.plugin_name)


def get_registry() -> Registry:
    """The process's registry, built on the first call from the plugins registered on
    ``get_plugin_manager()`` at that moment."""
    global _registry
    with _lock:
        if _registry is None:
            _registry = build_registry(get_plugin_manager())
        return _registry


def reset_plugins() -> None:
    """Forget the loaded plugins and the registry (for tests): the next call loads them again."""
    global _plugin_manager, _registry
    with _lock:
        _plugin_manager = None
        _registry = None

