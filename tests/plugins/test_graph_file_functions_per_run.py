"""A graph file's own functions belong to its graph for as long as the process runs: one process may
plan several graphs and run them in any order (a notebook, a sweep), and each run uses what its own
graph registered. A graph file that shadows a built-in never changes what another graph runs: one
loaded after it, a registered algorithm by name included, gets the built-in."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from flowrl import api
from flowrl.plugins.manager import load_plugins
from flowrl.runtime.serial import run_serial

TINY = ["steps=1", "seed=0", "progress=false", "checkpoint=false", "rollout.prompts_per_step=2"]
TINY += ["rollout.max_new_tokens=2"]

SFT_MARKED = """
from flowrl import register
from flowrl.contract import sequences_in
from flowrl.graph import Graph


@register.loss("sft", needs=())
def sft(logprobs, batch, algo):
    mask = sequences_in(batch, "sft").sampled_mask
    return -(logprobs * mask).sum() / mask.sum(), {{"which": {which}.0}}


def build(cfg):
    g = Graph("{name}")
    g.model("actor", "actor")
    g.generate("rollout", model="actor", reads="prompts", writes="responses", n=2)
    g.train("train_actor", model="actor", loss="sft", reads="responses")
    return g
"""

# registers its own advantage estimator under the built-in GRPO's name (zero advantages, and a metric)
OWN_GRPO = """
from flowrl import register
from flowrl.contract import sequences_in
from flowrl.graph import Graph


@register.compute("grpo", needs=("rewards", "responses"), gives=("advantages",))
def grpo(inputs, algo):
    mask = sequences_in(inputs, "grpo").sampled_mask
    return {"advantages": 0.0 * mask}, {"own_grpo": 1.0}


def build(cfg):
    g = Graph("own_grpo")
    g.model("actor", "actor")
    g.generate("rollout", model="actor", reads="prompts", writes="responses", n=2)
    g.forward("old_logprobs", model="actor", output="logprobs", reads="responses", writes="old_logprobs")
    g.reward("reward", fn="task", reads="prompts responses", writes="rewards")
    g.compute("advantages", fn="grpo", reads="rewards responses", writes="advantages")
    g.train("train_actor", model="actor", loss="ppo", reads="responses old_logprobs advantages")
    return g
"""


def _file(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def _plan(source: str, reg, tmp_path: Path, out: str):
    return api.plan(source, registry=reg, overrides=[*TINY, f"out={tmp_path / out}"], emit=lambda s: None)


def test_two_graphs_shadowing_one_builtin_each_run_their_own_whatever_was_planned_last(tmp_path):
    reg = load_plugins(entry_points=False)[1]
    one = _plan(_file(tmp_path, "one", SFT_MARKED.format(which=1, name="one")), reg, tmp_path, "r1")
    two = _plan(_file(tmp_path, "two", SFT_MARKED.format(which=2, name="two")), reg, tmp_path, "r2")
    assert api.run(*one, registry=reg).metrics[0]["train_actor/which"] == 1.0
    assert api.run(*two, registry=reg).metrics[0]["train_actor/which"] == 2.0
    assert run_serial(*one, registry=reg).metrics[0]["train_actor/which"] == 1.0


def test_a_graph_file_planned_before_a_graph_of_the_builtins_still_runs_its_own(tmp_path):
    reg = load_plugins(entry_points=False)[1]
    mine = _plan(_file(tmp_path, "mine", SFT_MARKED.format(which=3, name="mine")), reg, tmp_path, "r1")
    plain = SFT_MARKED.split("def build")[0].split("@register")[0] + "def build" + SFT_MARKED.split("def build")[1]
    theirs = _plan(_file(tmp_path, "plain", plain.format(name="plain")), reg, tmp_path, "r2")
    assert "train_actor/which" not in api.run(*theirs, registry=reg).metrics[0]  # the built-in sft
    assert api.run(*mine, registry=reg).metrics[0]["train_actor/which"] == 3.0


@pytest.mark.slow
def test_an_algorithm_by_name_after_a_file_shadowing_its_functions_gets_the_builtins(tmp_path):
    reg = load_plugins(entry_points=False)[1]
    own = _plan(_file(tmp_path, "own", OWN_GRPO), reg, tmp_path, "r1")
    builtin = _plan("grpo", reg, tmp_path, "r2")
    assert reg.entry("compute_functions", "grpo").plugin == "flowrl.plugins.builtin"
    assert "advantages/own_grpo" not in api.run(*builtin, registry=reg).metrics[0]
    assert api.run(*own, registry=reg).metrics[0]["advantages/own_grpo"] == 1.0
