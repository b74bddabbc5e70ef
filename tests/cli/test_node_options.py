"""Node options from the command line and config files: `--set nodes.NAME.OPTION=VALUE` and
`nodes: {NAME: {OPTION: VALUE}}` go over the options the graph gives its nodes, are resolved into the
plan, and reach the function the node calls; unknown nodes and options are refused, named."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import SMALL_RUN, run_cli

from flowrl import api
from flowrl.specs import read_document

SMALL = SMALL_RUN


def quiet(_: str) -> None:
    pass


def test_set_nodes_name_option_is_resolved_into_the_plan() -> None:
    overrides = [*SMALL, "nodes.advantages.eps=1e-3", "nodes.train_actor.clip_low=0.1", "nodes.train_actor.epochs=2"]
    _, plan = api.plan("grpo", overrides=overrides, emit=quiet)
    assert plan.node_options("advantages").options == {"eps": 1e-3}
    assert plan.node_options("train_actor").algo.clip_low == 0.1  # an algo field, for this node alone
    assert plan.node_options("train_actor").options["epochs"] == 2
    assert plan.node_options("advantages").algo.clip_low == plan.config.algo.clip_low


def test_config_file_nodes_go_over_the_graphs_own_options(tmp_path: Path) -> None:
    _, plan = api.plan("dapo", overrides=SMALL, emit=quiet)
    assert plan.node_options("overlong").options["cache"] == 1  # dapo.py: max(budget // 4, 1)
    config = tmp_path / "run.yaml"
    config.write_text("nodes:\n  overlong:\n    cache: 0\n")
    _, plan = api.plan("dapo", overrides=SMALL, config_file=read_document(config), emit=quiet)
    assert plan.node_options("overlong").options == {"max_length": 2, "cache": 0}
    assert plan.config.nodes == {"overlong": {"cache": 0}}


def test_an_unknown_node_is_refused_naming_it_and_the_graphs_nodes(capsys) -> None:
    code, _, err = run_cli(capsys, "plan", "grpo", "--set", "nodes.advantagez.eps=1e-3")
    assert code == 2 and "Traceback" not in err
    assert "config field 'nodes.advantagez': graph 'grpo' has no node 'advantagez'" in err, err
    assert "Did you mean 'advantages'?" in err
    assert "Its nodes: rollout, old_logprobs, ref_logprobs, reward, advantages, train_actor." in err


def test_an_unknown_option_is_refused_naming_the_config_field(capsys) -> None:
    code, _, err = run_cli(capsys, "plan", "grpo", "--set", "nodes.advantages.epz=1e-3")
    assert code == 2 and "Traceback" not in err
    assert "node 'advantages': unknown option(s) epz (set by the config: nodes.advantages.epz)" in err, err
    assert "allowed: " in err and "eps" in err
    code, _, err = run_cli(capsys, "plan", "grpo", "--set", "nodes.advantages.eps=abc")
    assert code == 2 and "option 'eps' = 'abc' does not fit its type" in err, err


def test_a_node_option_outside_nodes_is_an_unknown_field_that_says_where_it_goes(capsys) -> None:
    code, _, err = run_cli(capsys, "plan", "grpo", "--set", "advantages.eps=1e-3")
    assert code == 2 and "unknown field 'advantages'" in err and "--set nodes.advantages.OPTION=VALUE" in err, err


@pytest.mark.parametrize(
    ("graph", "setting"),
    [("dapo", "nodes.dynamic_sampling.max_rounds=5"), ("tool_use", "nodes.episodes.turns=3")],
)
def test_a_nodes_graph_field_is_named_as_such_not_as_an_unknown_option(capsys, tmp_path, graph, setting) -> None:
    """A node's own graph fields (a filter's ``max_rounds``, a generate node's ``turns``), which the graph
    file sets and `flowrl show` prints, are refused as part of the graph, not as unknown options."""
    code, _, err = run_cli(capsys, "plan", graph, "--set", setting, "--out", str(tmp_path / "p.yaml"))
    field = setting.split(".")[2].split("=")[0]
    assert code == 2 and field in err, err
    assert "unknown option" not in err and "graph" in err, err


def test_an_algo_field_out_of_range_is_refused_config_wide(capsys, tmp_path: Path) -> None:
    small = ["--set", "rollout.prompts_per_step=2", "--set", "rollout.samples_per_prompt=2"]
    out = str(tmp_path / "p.yaml")
    code, _, err = run_cli(capsys, "plan", "grpo", *small, "--set", "algo.clip_low=5", "--out", out)
    assert code == 2 and "algo.clip_low' must be in (0, 1)" in err, err


@pytest.mark.parametrize(
    "setting",
    [
        "nodes.train_actor.clip_low=5",
        "nodes.train_actor.dual_clip=0.5",
        "nodes.train_actor.is_cap=0",
        "nodes.advantages.clip_high=-1",
    ],
)
def test_an_algo_field_out_of_range_for_one_node_is_refused_naming_the_node(capsys, tmp_path: Path, setting) -> None:
    """`--set nodes.NAME.FIELD=VALUE` for an algo field meets the checks of `--set algo.FIELD=VALUE`."""
    small = ["--set", "rollout.prompts_per_step=2", "--set", "rollout.samples_per_prompt=2"]
    out = tmp_path / "p.yaml"
    code, _, err = run_cli(capsys, "plan", "grpo", *small, "--set", setting, "--out", str(out))
    node, field = setting.split(".")[1], setting.split(".")[2].split("=")[0]
    assert code == 2 and "Traceback" not in err, err
    assert node in err and field in err, err
    assert not out.exists()


SPY = """
from pathlib import Path

from flowrl import register
from flowrl.graph import Graph

SEEN = Path({seen!r})


@register.compute("spy_centered", needs=("rewards", "responses"), gives=("advantages",))
def spy_centered(inputs, algo, *, tag: str = "default", scale: float = 1.0):
    SEEN.write_text(f"{{tag}} {{scale}} {{algo.clip_low}}")
    seqs = inputs["responses"]
    r = inputs["rewards"].float()
    return {{"advantages": scale * (r - r.mean())[:, None] * seqs.sampled_mask}}


def build(cfg):
    g = Graph("spy")
    g.model("actor", "actor")
    g.generate("rollout", model="actor", n=cfg.rollout.samples_per_prompt)
    g.forward("old", model="actor", output="logprobs", writes="old_logprobs")
    g.reward("reward", fn="task")
    g.compute("adv", fn="spy_centered", reads="rewards responses", writes="advantages", tag="graph", scale=2.0)
    g.train("train", model="actor", loss="ppo", reads="responses old_logprobs advantages")
    return g
"""


def test_the_function_a_node_calls_receives_the_configured_options(capsys, tmp_path: Path) -> None:
    seen = tmp_path / "seen.txt"
    graph = tmp_path / "spy.py"
    graph.write_text(SPY.format(seen=str(seen)))
    argv = ["run", str(graph), "--steps", "1", "--quiet", "--out", str(tmp_path / "runs")]
    argv += [f"--set={s}" for s in [*SMALL, "checkpoint=false", "nodes.adv.tag=config", "nodes.adv.clip_low=0.1"]]
    code, _, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert seen.read_text() == "config 2.0 0.1"  # the config's tag over the graph's; the graph's scale kept
