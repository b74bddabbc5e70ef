"""Load plugins (built-ins and entry points) and collect what they register.

Built-in modules are registered through the same ``pm.register`` as entry-point plugins.
``FLOWRL_PLUGINS`` (comma-separated entry-point names) restricts which external plugins load;
set it to an empty string to load none.
"""

from __future__ import annotations

import difflib
import importlib.metadata as md
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pluggy

from flowrl.errors import PluginError
from flowrl.plugins import hookspecs

ENTRY_POINT_GROUP = "flowrl"

#: Modules that implement the hooks for flowrl's own components.
BUILTIN_MODULES = ("flowrl.plugins.builtin",)


@dataclass(frozen=True)
class Entry:
    name: str
    obj: Any
    plugin: str
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PluginInfo:
    name: str
    source: str  # "built-in", or "dist-name version (entry point module:attr)"


SINGULAR = {
    "algorithms": "algorithm",
    "advantage_estimators": "advantage estimator",
    "losses": "loss",
    "reward_functions": "reward function",
    "tasks": "task",
    "backends": "backend",
    "passes": "pass",
    "hardware": "hardware preset",
    "cost_models": "cost model",
    "cli_commands": "CLI command",
}


class Registry:
    """kind -> name -> Entry, filled from the hooks."""

    def __init__(self) -> None:
        self._items: dict[str, dict[str, Entry]] = {kind: {} for kind in hookspecs.HOOKS.values()}
        self.plugins: list[PluginInfo] = []

    def add(self, kind: str, plugin: str, name: str, obj: Any, **meta: Any) -> None:
        table = self._items[kind]
        if not isinstance(name, str) or not name:
            raise PluginError(f"plugin '{plugin}' registered a {SINGULAR[kind]} with an invalid name {name!r}.")
        if name in table:
            raise PluginError(f"{SINGULAR[kind]} '{name}' is registered twice: by '{table[name].plugin}' and by '{plugin}'. Rename one of them.")
        table[name] = Entry(name=name, obj=obj, plugin=plugin, meta=meta)

    def entry(self, kind: str, name: str) -> Entry:
        table = self._items[kind]
        if name not in table:
            what = SINGULAR[kind]
            hint = difflib.get_close_matches(name, list(table), n=1)
            did = f" Did you mean '{hint[0]}'?" if hint else ""
            raise PluginError(f"unknown {what} '{name}'.{did} Known: {', '.join(sorted(table)) or 'none'}. Plugins add more (see `flowrl plugins`).")
        return table[name]

    def get(self, kind: str, name: str) -> Any:
        return self.entry(kind, name).obj

    def names(self, kind: str) -> list[str]:
        return sorted(self._items[kind])

    def entries(self, kind: str) -> list[Entry]:
        return [self._items[kind][n] for n in self.names(kind)]

    def kinds(self) -> list[str]:
        return list(self._items)


def _allowed() -> set[str] | None:
    raw = os.environ.get("FLOWRL_PLUGINS")
    if raw is None:
        return None
    return {p.strip() for p in raw.split(",") if p.strip()}


def load_plugins(*, entry_points: bool = True, extra: Iterable[tuple[str, Any]] = (), allow: set[str] | None = None) -> tuple[pluggy.PluginManager, Registry]:
    """Build a plugin manager and a filled registry.

    ``extra`` are (name, plugin object) pairs registered after the built-ins (tests use this to
    add fakes without touching entry points). ``allow`` overrides ``FLOWRL_PLUGINS``.
    """
    import importlib

    pm = pluggy.PluginManager(ENTRY_POINT_GROUP)
    pm.add_hookspecs(hookspecs)
    registry = Registry()
    for module_name in BUILTIN_MODULES:
        pm.register(importlib.import_module(module_name), name=module_name)
        registry.plugins.append(PluginInfo(module_name, "built-in"))
    if entry_points:
        allow = _allowed() if allow is None else allow
        for ep in sorted(md.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            if allow is not None and ep.name not in allow:
                continue
            if pm.has_plugin(ep.name):
                continue
            try:
                plugin = ep.load()
            except Exception as exc:  # a broken plugin must not hide which one it is
                raise PluginError(f"plugin '{ep.name}' (entry point {ep.value}) failed to import: {type(exc).__name__}: {exc}") from exc
            _register(pm, ep.name, plugin)
            dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist else "unknown distribution"
            registry.plugins.append(PluginInfo(ep.name, f"{dist} (entry point {ep.value})"))
    for name, plugin in extra:
        _register(pm, name, plugin)
        registry.plugins.append(PluginInfo(name, "registered in-process"))
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"plugin '{pm.get_name(exc.plugin)}' implements an unknown hook: {exc}. Known hooks: {', '.join(hookspecs.HOOKS)}.") from None
    for hook_name, kind in hookspecs.HOOKS.items():
        hook = getattr(pm.hook, hook_name)
        for impl in hook.get_hookimpls():  # pluggy lists them in registration order
            def register(name: str, obj: Any, _kind: str = kind, _plugin: str = impl.plugin_name, **meta: Any) -> None:
                registry.add(_kind, _plugin, name, obj, **meta)

            impl.function(register=register)
    return pm, registry


def _register(pm: pluggy.PluginManager, name: str, plugin: Any) -> None:
    try:
        pm.register(plugin, name=name)
    except (ValueError, pluggy.PluginValidationError) as exc:
        raise PluginError(f"plugin '{name}' could not be registered: {exc}") from None


_CACHE: Registry | None = None


def registry() -> Registry:
    """The process-wide registry (loaded once)."""
    global _CACHE
    if _CACHE is None:
        _CACHE = load_plugins()[1]
    return _CACHE


def set_registry(reg: Registry | None) -> None:
    """Replace (or with None, reset) the process-wide registry; for tests and embedding."""
    global _CACHE
    _CACHE = reg
