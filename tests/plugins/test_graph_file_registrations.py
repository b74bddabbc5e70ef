"""What a graph file registers (``flowrl.register``) against what flowrl and plugins register.

A graph file written before flowrl gained a built-in (or before a plugin of the same name was
installed) keeps working: inside that graph its own function wins, with a one-line notice. Plugins
keep the strict check: two plugins (or a plugin and a built-in) registering one name is an error,
and so is a graph file registering one name twice, or two graph files one name.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

from flowrl import api
from flowrl.errors import PluginError
from flowrl.plugins.hookspecs import hookimpl
from flowrl.plugins.manager import BUILTIN_MODULES, Registry, load_plugins

HEADER = """
from flowrl import register
from flowrl.graph import Graph
from flowrl.runtime.batch import sequences_in
"""

# written against an API that had no built-in `sft` loss: it registers its own
OWN_SFT = """
@register.loss("sft", needs=())
def sft(logprobs, batch, algo):
    mask = sequences_in(batch, "sft").sampled_mask
    return -(logprobs * mask).sum() / mask.sum(), {"own_sft": 1.0}


def build(cfg):
    g = Graph("old_sft")
    g.model("actor", "actor")
    g.generate("rollout", model="actor", reads="prompts", writes="responses", n=2)
    g.train("train_actor", model="actor", loss="sft", reads="responses")
    return g
"""

USES_BUILTIN_SFT = """
def build(cfg):
    g = Graph("plain_sft")
    g.model("actor", "actor")
    g.generate("rollout", model="actor", reads="prompts", writes="responses", n=2)
    g.train("train_actor", model="actor", loss="sft", reads="responses")
    return g
"""

TINY = ["steps=1", "seed=0", "progress=false", "checkpoint=false", "rollout.prompts_per_step=2"]


def _file(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(HEADER + textwrap.dedent(body))
    return str(path)


def _registry(*extra: tuple[str, Any]) -> Registry:
    return load_plugins(entry_points=False, extra=extra)[1]


def _notices(err: str) -> list[str]:
    return [line for line in err.splitlines() if "shadows the built-in" in line]


def test_a_graph_file_registering_a_builtin_name_loads_with_its_own_function_and_one_notice(tmp_path, capsys):
    src = _file(tmp_path, "old_sft", OWN_SFT)
    reg = _registry()
    builtin = reg.entry("losses", "sft")
    graph, _ = api.load(src, registry=reg)
    entry = reg.entry("losses", "sft")
    assert entry.plugin == f"graph file {src}" and entry.obj is not builtin.obj
    assert reg.shadowed("losses", "sft") is builtin and builtin.plugin in BUILTIN_MODULES
    assert graph.nodes["train_actor"].loss == "sft"
    api.load(src, registry=reg)  # the same file again (a run plans, then rebuilds the graph): no second notice
    (notice,) = _notices(capsys.readouterr().err)
    assert notice == (
        f"flowrl: note: {src} registers loss 'sft', which shadows the built-in of that name in this graph."
    )


OWN_REWARD = """
@register.reward("task")
def own(prompts, responses, task):
    return [0.0] * len(responses)
"""

OWN_COMPUTE = """
@register.compute("grpo", needs=("rewards",), gives=("advantages",))
def own(inputs, algo):
    return {}
"""


@pytest.mark.parametrize(
    ("body", "kind", "name"), [(OWN_REWARD, "reward_functions", "task"), (OWN_COMPUTE, "compute_functions", "grpo")]
)
def test_each_kind_a_graph_file_registers_may_shadow_a_builtin(tmp_path, capsys, body, kind, name):
    src = _file(tmp_path, "own", body + USES_BUILTIN_SFT)
    reg = _registry()
    api.load(src, registry=reg)
    assert reg.entry(kind, name).plugin == f"graph file {src}" and reg.shadowed(kind, name) is not None
    (notice,) = _notices(capsys.readouterr().err)
    assert f"registers {reg.singular(kind)} '{name}'" in notice


def test_a_graph_shadowing_a_builtin_runs_and_trains_with_its_own_loss(tmp_path, capsys):
    src = _file(tmp_path, "old_sft", OWN_SFT)
    reg = _registry()
    graph, plan = api.plan(src, registry=reg, overrides=TINY, emit=lambda s: None)
    result = api.run(graph, plan, registry=reg, out_dir=tmp_path / "run")
    (record,) = result.metrics
    assert record["train_actor/own_sft"] == 1.0  # the graph file's loss was the one called
    assert len(_notices(capsys.readouterr().err)) == 1


def test_another_graph_loaded_after_it_sees_the_builtin(tmp_path, capsys):
    reg = _registry()
    builtin = reg.entry("losses", "sft")
    api.load(_file(tmp_path, "old_sft", OWN_SFT), registry=reg)
    api.load(_file(tmp_path, "plain_sft", USES_BUILTIN_SFT), registry=reg)
    assert reg.entry("losses", "sft") is builtin and reg.shadowed("losses", "sft") is None
    # and a second file shadowing the same built-in is no clash with the first: each graph has its own
    second = _file(tmp_path, "old_sft_too", OWN_SFT.replace('Graph("old_sft")', 'Graph("old_sft_too")'))
    api.load(second, registry=reg)
    assert reg.entry("losses", "sft").plugin == f"graph file {second}"
    assert len(_notices(capsys.readouterr().err)) == 2


def test_a_graph_file_registering_one_name_twice_is_an_error(tmp_path):
    body = OWN_SFT.replace("def build", 'register.loss("sft", needs=())(sft)\n\n\ndef build')
    src = _file(tmp_path, "twice", body)
    with pytest.raises(PluginError, match=r"registers two functions named 'sft' \(losses\)") as info:
        api.load(src, registry=_registry())
    assert "twice.py" in str(info.value)


class _Loss:
    """A plugin registering loss ``name``."""

    def __init__(self, name: str) -> None:
        self.name = name

    @hookimpl
    def register_losses(self, register: Any) -> None:
        register(self.name, lambda outputs, batch, algo: (outputs.sum(), {}))


def test_two_plugins_registering_one_name_are_still_refused():
    with pytest.raises(PluginError, match="loss 'mine' is registered twice: by 'first' and by 'second'"):
        _registry(("first", _Loss("mine")), ("second", _Loss("mine")))


def test_a_plugin_registering_a_builtin_name_is_still_refused():
    with pytest.raises(PluginError, match="loss 'sft' is registered twice: by 'flowrl.plugins.builtin' and by 'late'"):
        _registry(("late", _Loss("sft")))


def test_a_graph_file_shadows_an_installed_plugins_name_inside_its_graph(tmp_path, capsys):
    """Installing a plugin never breaks a graph: the file's own function wins there, with a note naming the
    plugin, and the plugin's entry comes back for the next graph."""
    reg = _registry(("mine_plugin", _Loss("mine")))
    plugin_entry = reg.entry("losses", "mine")
    src = _file(tmp_path, "clash", OWN_SFT.replace('register.loss("sft"', 'register.loss("mine"'))
    api.load(src, registry=reg)
    assert reg.entry("losses", "mine").plugin == f"graph file {src}"
    assert reg.shadowed("losses", "mine") is plugin_entry
    err = " ".join(capsys.readouterr().err.split())
    assert "registers loss 'mine', which shadows plugin 'mine_plugin''s entry of that name in this graph" in err
    reg.release("graph file elsewhere.py")
    assert reg.entry("losses", "mine") is plugin_entry
