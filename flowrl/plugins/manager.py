"""Load plugins (built-ins and entry points) and collect what they register.

Built-in modules are registered through the same ``pm.register`` as entry-point plugins.
``FLOWRL_PLUGINS`` (comma-separated entry-point names) restricts which external plugins load;
set it to an empty string to load none.

Everything registered is checked on the spot (callable, signature, metadata), and an exception
in a plugin's hook becomes a :class:`PluginError` naming the plugin and the hook.
"""

from __future__ import annotations

import importlib.metadata as md
import inspect
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pluggy

from flowrl.errors import ConfigError, PluginError, did_you_mean
from flowrl.plugins import hookspecs
from flowrl.plugins.kinds import KINDS, NODE_FUNCTION_KINDS, canonical

ENTRY_POINT_GROUP = "flowrl"

#: Modules that implement the hooks for flowrl's own components.
BUILTIN_MODULES = ("flowrl.plugins.builtin",)
#: How a graph file's own registrations name their plugin: ``graph file PATH``.
GRAPH_FILE = "graph file "


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


#: How messages name one entry of each kind ("compute function").
SINGULAR: dict[str, str] = {k.name: k.singular for k in KINDS}

#: flowrl's own sub-commands (flowrl.cli); a plugin command may not reuse one of these names.
CORE_COMMANDS = ("run", "plan", "calibrate", "show", "plugins", "data")

#: How flowrl calls what each kind registers; the positional arguments are bound against its signature.
CALLS: dict[str, str] = {k.name: k.call for k in KINDS if k.call is not None}

#: Callables passed as metadata: kind -> key -> (how flowrl calls it, whether it is required).
META_CALLS: dict[str, dict[str, tuple[str, bool]]] = {k.name: dict(k.meta_calls) for k in KINDS if k.meta_calls}

LOSS_OUTPUTS = ("logprobs", "values", "scores")  # scores: one per row (a reward model's)
#: How a loss reads the rows of its batch: each on its own, or in pairs (rows 2i and 2i+1: a preference
#: pair's chosen and rejected response, which the training engine keeps in one micro-batch)
LOSS_ROWS = ("each", "pairs")


class Registry:
    """kind -> name -> Entry, filled from the hooks. A kind's older name (``advantage_estimators``)
    finds the kind it names today (``compute_functions``)."""

    def __init__(self) -> None:
        self._items: dict[str, dict[str, Entry]] = {k.name: {} for k in KINDS}
        self.plugins: list[PluginInfo] = []
        # (kind, name) -> the built-in's or plugin's entry a graph file's own function of that name stands in for
        self._shadowed: dict[tuple[str, str], Entry] = {}

    def add(self, kind: str, plugin: str, name: str, obj: Any, *, again: bool = False, **meta: Any) -> None:
        """Register ``obj``; ``again``: the same plugin may replace its own entry (a graph file
        imported a second time)."""
        kind = canonical(kind)
        table = self._items[kind]
        what = SINGULAR[kind]
        if not isinstance(name, str) or not name:
            raise PluginError(f"plugin '{plugin}' registered a {what} with an invalid name {name!r}.")
        if name in table and not (again and table[name].plugin == plugin):
            raise PluginError(
                f"{what} '{name}' is registered twice: by '{table[name].plugin}' and by '{plugin}'. Rename one of them."
            )
        problem = _problem(kind, name, obj, meta)
        if problem:
            raise PluginError(f"plugin '{plugin}' registered {what} '{name}', but {problem}.")
        table[name] = Entry(name=name, obj=obj, plugin=plugin, meta=meta)

    def add_own(self, kind: str, graph_file: str, name: str, obj: Any, **meta: Any) -> Entry | None:
        """Register a graph file's own function. Inside the graph it wins over a built-in or an installed
        plugin's entry of the same name (that entry is kept aside, and comes back when another graph file
        is loaded: `release`), so that a built-in added or a plugin installed later never breaks a graph
        written before it; a name another graph file holds, or one this file registers twice, is refused
        as by `add`. Returns the entry it newly shadows, if it does (what the loader tells the user, once)."""
        kind = canonical(kind)
        held = self._items[kind].get(name)
        if held is None or held.plugin.startswith(GRAPH_FILE):  # nothing to shadow: `add` decides
            self.add(kind, graph_file, name, obj, again=True, **meta)
            return None
        del self._items[kind][name]
        try:
            self.add(kind, graph_file, name, obj, again=True, **meta)
        except PluginError:
            self._items[kind][name] = held
            raise
        self._shadowed[(kind, name)] = held
        return held

    def release(self, graph_file: str) -> None:
        """Give back the entries that graph files other than ``graph_file`` shadow: one graph's own
        functions never stand in for a built-in's or a plugin's in another graph."""
        for (kind, name), builtin in list(self._shadowed.items()):
            if self._items[kind][name].plugin != graph_file:
                self._items[kind][name] = builtin
                del self._shadowed[(kind, name)]

    def claim(self, graph_file: str, registered: Iterable[tuple[str, str, Any, dict[str, Any]]]) -> None:
        """Put graph file ``graph_file``'s own functions (``(kind, name, fn, meta)``, as it registered them)
        back in force, silently: a run of its graph uses them even when another graph file was loaded after
        it (which gave back the built-ins it shadowed, or shadowed them with its own)."""
        self.release(graph_file)
        for kind, name, obj, meta in registered:
            self.add_own(kind, graph_file, name, obj, **meta)

    def singular(self, kind: str) -> str:
        """How messages name one entry of ``kind`` ("loss", "compute function")."""
        return SINGULAR[canonical(kind)]

    def shadowed(self, kind: str, name: str) -> Entry | None:
        """The built-in's or plugin's entry a graph file's own ``name`` of ``kind`` stands in for, if one does."""
        return self._shadowed.get((canonical(kind), name))

    def entry(self, kind: str, name: str, *, field: str | None = None) -> Entry:
        """The entry ``name`` of ``kind``; ``field``: the config field that named it (a ConfigError then)."""
        kind = canonical(kind)
        table = self._items[kind]
        if name not in table:
            known = ", ".join(sorted(table)) or "none"
            message = (
                f"unknown {SINGULAR[kind]} '{name}'.{did_you_mean(name, list(table))} Known: {known}. Plugins add "
                "more (see `flowrl plugins`)."
            )
            raise PluginError(message) if field is None else ConfigError(f"config field '{field}': {message}")
        return table[name]

    def get(self, kind: str, name: str) -> Any:
        return self.entry(kind, name).obj

    def names(self, kind: str) -> list[str]:
        return sorted(self._items[canonical(kind)])

    def entries(self, kind: str) -> list[Entry]:
        table = self._items[canonical(kind)]
        return [table[n] for n in sorted(table)]

    def kinds(self) -> list[str]:
        return list(self._items)


def _problem(kind: str, name: str, obj: Any, meta: dict[str, Any]) -> str | None:
    """Why ``obj`` (with ``meta``) cannot be registered as a ``kind`` named ``name``; None if it can."""
    if kind == "tasks":
        return None if isinstance(obj, type) else f"{obj!r} is not a class"
    if kind in ("generation_engines", "training_engines") and "capabilities" in meta:
        from flowrl.contract.capabilities import EngineCapabilities

        if not isinstance(meta["capabilities"], EngineCapabilities):
            return (
                f"meta 'capabilities' is {meta['capabilities']!r}; it must be a "
                "flowrl.contract.EngineCapabilities (what the engine can compute)"
            )
    if kind == "hardware":
        from flowrl.planner.hardware import HardwareSpec  # lazy: the planner is not needed to load plugins

        return None if isinstance(obj, HardwareSpec) else f"{obj!r} is not a flowrl.planner.hardware.HardwareSpec"
    if kind == "cli_commands" and name in CORE_COMMANDS:
        return f"'{name}' is a core flowrl command: rename the plugin's command"
    if kind == "losses" and "output" in meta and meta["output"] not in LOSS_OUTPUTS:
        return f"meta 'output' is {meta['output']!r}; it must be one of {', '.join(map(repr, LOSS_OUTPUTS))}"
    if kind == "losses" and meta.get("rows", "each") not in LOSS_ROWS:
        return f"meta 'rows' is {meta['rows']!r}; it must be one of {', '.join(map(repr, LOSS_ROWS))}"
    for key in ("needs", "gives", "optional"):
        keys = meta.get(key, ())
        if not isinstance(keys, (tuple, list)) or not all(isinstance(k, str) for k in keys):
            return f"meta '{key}' is {keys!r}; it must be a tuple or list of strings"
    for key, (call, required) in META_CALLS.get(kind, {}).items():
        if key not in meta:
            if required:
                return f"meta '{key}' is missing: flowrl calls {call}"
            continue
        problem = _call_problem(meta[key], call)
        if problem:
            return f"for meta '{key}', {problem}"
    problem = _call_problem(obj, CALLS[kind])
    if kind == "executors":
        from flowrl.contract.capabilities import Capabilities

        if problem is None and not isinstance(getattr(obj, "capabilities", None), Capabilities):
            return (
                f"{obj!r} has no 'capabilities' attribute holding a flowrl.contract.Capabilities "
                "(register the executor class, with what it can run as a class attribute)"
            )
    return problem


def _call_problem(obj: Any, call: str) -> str | None:
    """Why ``obj`` cannot be called as ``call`` (e.g. ``"fn(inputs, algo, **options)"``); None if it can.

    The positional names of ``call`` are bound as dummy arguments; ``**options`` are optional and not bound.
    A signature that cannot be inspected (some builtins) is accepted.
    """
    if not callable(obj):
        return f"{obj!r} is not callable: flowrl calls {call}"
    inside = call[call.index("(") + 1 : -1]
    args = [a.strip() for a in inside.split(",") if a.strip() and not a.strip().startswith("*")]
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(*args)
    except TypeError as exc:
        return f"{obj!r} cannot be called as {call} ({exc})"
    return None


def _allowed() -> set[str] | None:
    raw = os.environ.get("FLOWRL_PLUGINS")
    if raw is None:
        return None
    return {p.strip() for p in raw.split(",") if p.strip()}


def load_plugins(
    *,
    entry_points: bool = True,
    extra: Iterable[tuple[str, Any]] = (),
    allow: set[str] | None = None,
    kinds: Iterable[str] | None = None,
) -> tuple[pluggy.PluginManager, Registry]:
    """Build a plugin manager and a filled registry.

    ``extra`` are (name, plugin object) pairs registered after the built-ins (tests use this to
    add fakes without touching entry points). ``allow`` overrides ``FLOWRL_PLUGINS``. ``kinds``:
    call only the hooks of these kinds (the CLI reads its sub-commands without loading what the
    other hooks import, torch among it).
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
                raise PluginError(
                    f"plugin '{ep.name}' (entry point {ep.value}) failed to import: {type(exc).__name__}: {exc}"
                ) from exc
            _register(pm, ep.name, plugin)
            dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist else "unknown distribution"
            registry.plugins.append(PluginInfo(ep.name, f"{dist} (entry point {ep.value})"))
    for name, plugin in extra:
        _register(pm, name, plugin)
        registry.plugins.append(PluginInfo(name, "registered in-process"))
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        known = ", ".join(hookspecs.HOOKS)
        raise PluginError(
            f"plugin '{pm.get_name(exc.plugin)}' implements an unknown hook: {exc}. Known hooks: {known}."
        ) from None
    wanted = None if kinds is None else {canonical(k) for k in kinds}
    for hook_name, kind in hookspecs.HOOKS.items():
        if wanted is not None and kind not in wanted:
            continue
        for impl in getattr(pm.hook, hook_name).get_hookimpls():  # pluggy lists them in registration order
            _call_hook(registry, hook_name, kind, impl)
    return pm, registry


def _call_hook(registry: Registry, hook_name: str, kind: str, impl: pluggy.HookImpl) -> None:
    """Run one plugin's ``register_*`` hook into ``registry``; any error it raises names the plugin and hook."""
    refused: list[PluginError] = []  # our own refusals already name the plugin: passed on as they are

    def register(name: str, obj: Any, **meta: Any) -> None:
        try:
            registry.add(kind, impl.plugin_name, name, obj, **meta)
        except PluginError as exc:
            refused.append(exc)
            raise

    try:
        impl.function(register=register)
    except Exception as exc:
        if any(exc is r for r in refused):
            raise
        raise PluginError(
            f"plugin '{impl.plugin_name}' failed in hook {hook_name}: {type(exc).__name__}: {exc}"
        ) from exc


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


def cli_commands() -> list[Entry]:
    """The CLI sub-commands plugins register, read without calling the other hooks (fast: a
    loaded registry's, when there is one)."""
    if _CACHE is not None:
        return _CACHE.entries("cli_commands")
    return load_plugins(kinds=("cli_commands",))[1].entries("cli_commands")


def set_registry(reg: Registry | None) -> None:
    """Replace (or with None, reset) the process-wide registry; for tests and embedding."""
    global _CACHE
    _CACHE = reg


def node_functions(registry: Registry) -> dict[str, dict[str, Any]]:
    """kind -> name -> registered object, for every kind of function a graph node calls (the kinds the
    table marks ``node_function``: compute, loss, reward and filter functions, environments)."""
    return {kind: {e.name: e.obj for e in registry.entries(kind)} for kind in NODE_FUNCTION_KINDS}
