"""Plugin manager: built-in registrations, duplicates, unknown hooks, entry-point filtering."""

from __future__ import annotations

import importlib.metadata as md
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from flowrl.errors import PluginError
from flowrl.graph import Graph
from flowrl.plugins import manager
from flowrl.plugins.hookspecs import hookimpl
from flowrl.plugins.kinds import KINDS
from flowrl.plugins.manager import Registry, load_plugins
from flowrl.specs import RunConfig

BUILTIN = "flowrl.plugins.builtin"


@pytest.fixture(scope="module")
def builtin() -> Registry:
    return load_plugins(entry_points=False)[1]


# ---------------------------------------------------------------------------- built-ins


def test_builtin_registrations(builtin: Registry) -> None:
    assert builtin.names("algorithms") == [
        "dapo",
        "grpo",
        "ppo",
        "ppo_rm",
        "reinforce_pp",
        "remax",
        "rloo",
        "safe_rlhf",
        "tool_use",
        "two_agent",
    ]
    assert builtin.names("losses") == ["bradley_terry", "dpo", "gspo", "ppo", "sft", "value"]
    assert builtin.names("compute_functions") == [
        "followup_prompts",
        "gae",
        "group_mean",
        "grpo",
        "judge_prompts",
        "judge_scores",
        "lagrange_update",
        "lagrangian",
        "overlong",
        "reinforce_pp",
        "remax",
        "rloo",
        "weighted_sum",
    ]
    assert builtin.names("filters") == ["nonconstant", "threshold"]
    assert builtin.names("environments") == ["arithmetic", "calculator"]
    tasks = ["add", "calc", "copy", "data", "expr", "openenv", "reasoning_gym", "repeat", "verifiers"]
    assert builtin.names("tasks") == tasks
    assert builtin.names("executors") == ["local"]
    assert builtin.names("generation_engines") == ["local"]
    assert builtin.names("training_engines") == ["local"]
    assert builtin.names("passes") == ["memory", "micro_batch", "place", "resolve"]
    assert builtin.names("hardware") == ["A100-40G", "A100-80G", "H100-80G", "H20", "H200-141G"]
    assert builtin.names("cost_models") == ["analytic"]
    assert builtin.names("reward_functions") == ["agent", "code", "episode", "http", "task", "verbosity"]
    assert builtin.names("cli_commands") == ["profile"]
    assert builtin.kinds() == [k.name for k in KINDS]
    assert [p.name for p in builtin.plugins] == [BUILTIN]
    for kind in builtin.kinds():
        assert all(e.plugin == BUILTIN for e in builtin.entries(kind))


def test_builtin_metadata(builtin: Registry) -> None:
    assert builtin.entry("losses", "ppo").meta["output"] == "logprobs"
    assert builtin.entry("losses", "value").meta["output"] == "values"
    assert set(builtin.entry("compute_functions", "gae").meta["needs"]) >= {"rewards", "values"}
    assert tuple(builtin.entry("compute_functions", "gae").meta["gives"]) == ("advantages", "returns")
    assert builtin.entry("algorithms", "ppo").meta["source"].endswith("ppo.py")
    from flowrl.planner.passes import BUILTIN_PASSES

    for name, fn in BUILTIN_PASSES.items():
        assert builtin.get("passes", name) is fn


@pytest.mark.parametrize("name", ["ppo", "grpo", "remax", "rloo", "reinforce_pp"])
def test_registered_algorithms_build_verified_graphs(builtin: Registry, name: str) -> None:
    g = builtin.get("algorithms", name)(RunConfig())
    assert isinstance(g, Graph) and g.name == name
    g.verify()
    assert builtin.entry("algorithms", name).meta["description"]


def test_each_load_is_independent() -> None:
    _, a = load_plugins(entry_points=False)
    _, b = load_plugins(entry_points=False)
    assert a is not b and a.names("losses") == b.names("losses")


# ---------------------------------------------------------------------------- duplicates and bad plugins


class DuplicateTask:
    @hookimpl
    def register_tasks(self, register: Any) -> None:
        register("add", object, description="a second 'add'")


class TwoPlugins:
    def __init__(self, name: str) -> None:
        self.name = name

    @hookimpl
    def register_reward_functions(self, register: Any) -> None:
        register(self.name, lambda *a, **k: None)


def test_duplicate_name_names_both_plugins() -> None:
    with pytest.raises(PluginError) as info:
        load_plugins(entry_points=False, extra=[("dup_plugin", DuplicateTask())])
    message = str(info.value)
    assert "'add'" in message and "registered twice" in message
    assert f"'{BUILTIN}'" in message and "'dup_plugin'" in message


def test_duplicate_between_two_extra_plugins() -> None:
    with pytest.raises(PluginError) as info:
        load_plugins(entry_points=False, extra=[("first", TwoPlugins("same")), ("second", TwoPlugins("same"))])
    assert "reward function 'same' is registered twice" in str(info.value)
    assert "'first'" in str(info.value) and "'second'" in str(info.value)


def test_duplicate_blames_the_later_plugin() -> None:
    with pytest.raises(PluginError) as info:
        load_plugins(entry_points=False, extra=[("dup_plugin", DuplicateTask())])
    assert f"by '{BUILTIN}' and by 'dup_plugin'" in str(info.value)


def test_distinct_extra_plugins_register() -> None:
    _, reg = load_plugins(entry_points=False, extra=[("first", TwoPlugins("one")), ("second", TwoPlugins("two"))])
    assert reg.names("reward_functions") == ["agent", "code", "episode", "http", "one", "task", "two", "verbosity"]
    assert reg.entry("reward_functions", "two").plugin == "second"
    in_process = [("first", "registered in-process"), ("second", "registered in-process")]
    assert [(p.name, p.source) for p in reg.plugins][1:] == in_process


class Misspelled:
    @hookimpl
    def register_task(self, register: Any) -> None:  # should be register_tasks
        register("x", object)


def test_misspelled_hook_is_rejected() -> None:
    with pytest.raises(PluginError) as info:
        load_plugins(entry_points=False, extra=[("typo_plugin", Misspelled())])
    message = str(info.value)
    assert "typo_plugin" in message and "register_task" in message and "register_tasks" in message


class WrongSignature:
    @hookimpl
    def register_tasks(self, register: Any, extra: Any) -> None:
        pass


def test_hook_with_unknown_argument_is_rejected() -> None:
    with pytest.raises(PluginError, match="plugin 'sig_plugin' could not be registered"):
        load_plugins(entry_points=False, extra=[("sig_plugin", WrongSignature())])


def test_two_plugins_with_one_name() -> None:
    with pytest.raises(PluginError, match="plugin 'same_name' could not be registered"):
        load_plugins(entry_points=False, extra=[("same_name", TwoPlugins("a")), ("same_name", TwoPlugins("b"))])


class EmptyName:
    @hookimpl
    def register_reward_functions(self, register: Any) -> None:
        register("", object)


def test_invalid_name_is_rejected() -> None:
    with pytest.raises(PluginError, match="plugin 'empty' registered a .* with an invalid name ''"):
        load_plugins(entry_points=False, extra=[("empty", EmptyName())])


# ---------------------------------------------------------------------------- registry lookups


def test_unknown_name_gets_a_hint(builtin: Registry) -> None:
    with pytest.raises(PluginError) as info:
        builtin.get("algorithms", "grop")
    message = str(info.value)
    assert "unknown algorithm 'grop'" in message and "Did you mean 'grpo'?" in message
    assert "Known: dapo, grpo, ppo, ppo_rm, reinforce_pp, remax, rloo, safe_rlhf, tool_use, two_agent" in message
    with pytest.raises(PluginError) as info:
        builtin.get("tasks", "zzzzzz")
    assert "Did you mean" not in str(info.value) and "unknown task 'zzzzzz'" in str(info.value)


@pytest.mark.parametrize(("kind", "singular"), [("losses", "loss"), ("passes", "pass")])
def test_unknown_name_message_uses_the_right_singular(builtin: Registry, kind: str, singular: str) -> None:
    with pytest.raises(PluginError, match=f"^unknown {singular} 'nope'"):
        builtin.get(kind, "nope")


def test_process_registry_is_cached_and_replaceable(monkeypatch: pytest.MonkeyPatch, builtin: Registry) -> None:
    monkeypatch.setattr(manager, "_CACHE", None)
    monkeypatch.setenv("FLOWRL_PLUGINS", "")
    first = manager.registry()
    assert manager.registry() is first
    manager.set_registry(builtin)
    assert manager.registry() is builtin
    manager.set_registry(None)
    assert manager.registry() is not builtin


# ---------------------------------------------------------------------------- entry points


def test_empty_flowrl_plugins_loads_no_entry_points(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOWRL_PLUGINS", "")
    _, reg = load_plugins()
    assert [p.name for p in reg.plugins] == [BUILTIN]
    assert "grpo" in reg.names("algorithms") and "safe_rlhf" in reg.names("algorithms")
    assert reg.names("cli_commands") == ["profile"]


PLUGIN_SOURCE = """
from flowrl.plugins.hookspecs import hookimpl

@hookimpl
def register_reward_functions(register):
    register("ep_reward", lambda *a, **k: None, description="from an entry point")
"""


@pytest.fixture
def fake_entry_point(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """A module on sys.path exposed as entry point 'fake_ep' (the only one in group flowrl)."""
    module = "flowrl_test_fake_entry_point_plugin"
    (tmp_path / f"{module}.py").write_text(PLUGIN_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module, raising=False)
    eps = [md.EntryPoint(name="fake_ep", value=module, group="flowrl")]

    def entry_points(*, group: str) -> list[md.EntryPoint]:
        return eps if group == "flowrl" else []

    monkeypatch.setattr(manager, "md", types.SimpleNamespace(entry_points=entry_points))
    monkeypatch.delenv("FLOWRL_PLUGINS", raising=False)
    return module


def test_entry_point_plugin_loads(fake_entry_point: str) -> None:
    _, reg = load_plugins()
    assert reg.entry("reward_functions", "ep_reward").plugin == "fake_ep"
    info = reg.plugins[-1]
    assert info.name == "fake_ep" and f"(entry point {fake_entry_point})" in info.source


@pytest.mark.parametrize(
    ("allowed", "loaded"), [("", False), ("other", False), ("fake_ep", True), (" other , fake_ep ", True)]
)
def test_flowrl_plugins_filters_entry_points(
    monkeypatch: pytest.MonkeyPatch, fake_entry_point: str, allowed: str, loaded: bool
) -> None:
    monkeypatch.setenv("FLOWRL_PLUGINS", allowed)
    _, reg = load_plugins()
    assert ("ep_reward" in reg.names("reward_functions")) is loaded
    assert ("fake_ep" in [p.name for p in reg.plugins]) is loaded


def test_allow_argument_overrides_the_environment(monkeypatch: pytest.MonkeyPatch, fake_entry_point: str) -> None:
    monkeypatch.setenv("FLOWRL_PLUGINS", "")
    assert "ep_reward" in load_plugins(allow={"fake_ep"})[1].names("reward_functions")
    monkeypatch.setenv("FLOWRL_PLUGINS", "fake_ep")
    assert "ep_reward" not in load_plugins(allow=set())[1].names("reward_functions")
    assert "ep_reward" not in load_plugins(entry_points=False)[1].names("reward_functions")


def test_broken_entry_point_is_named(monkeypatch: pytest.MonkeyPatch, fake_entry_point: str, tmp_path: Path) -> None:
    (tmp_path / f"{fake_entry_point}.py").write_text("raise ImportError('missing dependency xyz')\n")
    with pytest.raises(PluginError) as info:
        load_plugins()
    message = str(info.value)
    assert "plugin 'fake_ep'" in message and "failed to import" in message and "missing dependency xyz" in message
