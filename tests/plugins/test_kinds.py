"""The one table of plugin kinds: hooks, messages, call checks and node functions derive from it;
older names (the hook register_advantage_estimators, @register.estimator) keep working."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from flowrl import register
from flowrl.errors import PluginError
from flowrl.plugins import hookspecs, manager
from flowrl.plugins.kinds import ALIASES, KINDS, NODE_FUNCTION_KINDS, canonical
from flowrl.plugins.manager import load_plugins, node_functions


def _hookspecs() -> dict[str, Any]:
    return {
        name: fn
        for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
        if getattr(fn, "flowrl_spec", None) is not None
    }


def test_every_hook_of_the_table_is_a_documented_hookspec_and_every_hookspec_is_in_the_table() -> None:
    specs = _hookspecs()
    table = {hook for k in KINDS for hook in k.hooks}
    assert set(specs) == table, (set(specs) ^ table, "a hookspec without a row in KINDS, or a row without a hookspec")
    assert hookspecs.HOOKS == {hook: k.name for k in KINDS for hook in k.hooks}
    for name, fn in specs.items():
        doc = (fn.__doc__ or "").strip()
        assert doc, f"hookspec {name} has no docstring"
        assert list(inspect.signature(fn).parameters) == ["register"], name


def test_the_tables_the_manager_uses_derive_from_kinds() -> None:
    names = [k.name for k in KINDS]
    assert len(set(names)) == len(names)
    assert list(manager.SINGULAR) == names
    assert set(manager.CALLS) == {k.name for k in KINDS if k.call is not None}
    assert manager.META_CALLS == {
        "executors": {"machine": ("machine(cfg)", False), "nodes": ("nodes(address)", False)},
        "cli_commands": {"run": ("run(args)", True)},
    }
    assert NODE_FUNCTION_KINDS == (
        "compute_functions", "losses", "reward_functions", "filters", "environments", "agents",
    )  # fmt: skip
    assert load_plugins(entry_points=False)[1].kinds() == names


def test_node_functions_are_the_kinds_graph_nodes_call() -> None:
    reg = load_plugins(entry_points=False)[1]
    functions = node_functions(reg)
    assert list(functions) == list(NODE_FUNCTION_KINDS)
    assert functions["compute_functions"]["grpo"] is reg.get("compute_functions", "grpo")
    assert set(functions["losses"]) == {"bradley_terry", "dpo", "gspo", "ppo", "sft", "value"}


def test_compute_functions_is_the_one_name_and_advantage_estimators_its_older_one() -> None:
    assert ALIASES == {"advantage_estimators": "compute_functions"}
    assert canonical("advantage_estimators") == "compute_functions" and canonical("losses") == "losses"
    reg = load_plugins(entry_points=False)[1]
    assert reg.names("advantage_estimators") == reg.names("compute_functions")
    assert reg.entry("advantage_estimators", "gae") is reg.entry("compute_functions", "gae")
    with pytest.raises(PluginError, match="unknown compute function 'nope'"):
        reg.get("compute_functions", "nope")


def _fn(inputs: Any, algo: Any) -> dict[str, Any]:
    return {}


class OldHook:
    """A third-party plugin written against the older hook name."""

    @hookspecs.hookimpl
    def register_advantage_estimators(self, register: Any) -> None:
        register("old_style", _fn, needs=("rewards",), gives=("advantages",))


class BothHooks:
    @hookspecs.hookimpl
    def register_compute_functions(self, register: Any) -> None:
        register("twice", _fn)

    @hookspecs.hookimpl
    def register_advantage_estimators(self, register: Any) -> None:
        register("twice", _fn)


def test_a_plugin_implementing_the_older_hook_registers_compute_functions() -> None:
    reg = load_plugins(entry_points=False, extra=[("old", OldHook())])[1]
    entry = reg.entry("compute_functions", "old_style")
    assert entry.plugin == "old" and entry.meta["gives"] == ("advantages",)
    assert "old_style" in node_functions(reg)["compute_functions"]


def test_the_older_and_newer_hook_fill_one_namespace() -> None:
    with pytest.raises(PluginError, match="compute function 'twice' is registered twice"):
        load_plugins(entry_points=False, extra=[("both", BothHooks())])


def test_the_older_hook_name_alone_loads_only_its_kind() -> None:
    reg = load_plugins(entry_points=False, kinds=("advantage_estimators",))[1]
    assert "grpo" in reg.names("compute_functions") and reg.names("losses") == []


def test_register_compute_and_its_older_name_estimator() -> None:
    assert register.estimator is register.compute
    register.take_pending()

    @register.estimator("by_old_name", needs=("rewards",), gives=("advantages",))
    def a(inputs: Any, algo: Any) -> dict[str, Any]:
        return {}

    @register.compute(gives=("advantages",))
    def by_new_name(inputs: Any, algo: Any) -> dict[str, Any]:
        return {}

    pending = register.take_pending()
    assert [(kind, name) for kind, name, _, _ in pending] == [
        ("compute_functions", "by_old_name"),
        ("compute_functions", "by_new_name"),
    ]
