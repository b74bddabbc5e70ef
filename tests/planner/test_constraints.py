"""`flowrl plan --require KEY=VALUE`: the tuner searches only plans that satisfy the constraints,
and --explain sets the best constrained plan beside the unconstrained winner."""

from __future__ import annotations

import json

import pytest

from flowrl.cli import main
from flowrl.contract.plan import load_plan

CLUSTER = ["--cluster", "16xA100-80G", "--model", "llama-7b", "--budget", "2"]


def test_required_placement_rollout_and_parallel_layout_hold_in_the_plan(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    require = ["--require", "placement=colocate", "--require", "rollout.mode=sync", "--require", "actor.tp=2"]
    assert main(["plan", "grpo", *CLUSTER, *require, "--require", "generation.tp=2", "--out", str(out)]) == 0
    layout = load_plan(out).layout
    assert layout.placement == "colocate" and layout.rollout.mode == "sync" and not layout.rollout.partial
    assert layout.layout("actor").parallel.tp == 2 and layout.generation.tp == 2


@pytest.mark.parametrize(
    ("graph", "placement", "devices"), [("grpo", "disaggregated", 8), ("ppo", "split", 8), ("grpo", "colocate", 16)]
)
def test_a_required_generation_group_size_holds_in_the_plan(tmp_path, graph, placement, devices):
    """``generation.devices``: the group generation runs on has that many devices (the generation group when
    disaggregated, the actor's group when split, every device colocated)."""
    out = tmp_path / "plan.yaml"
    require = ["--require", f"placement={placement}", "--require", f"generation.devices={devices}"]
    assert main(["plan", graph, *CLUSTER, *require, "--out", str(out)]) == 0
    layout = load_plan(out).layout
    group = next(g for g in layout.groups if g.name == layout.generation.group)
    assert layout.placement == placement and group.devices == devices
    assert layout.generation.replicas * layout.generation.tp == devices


def test_a_generation_group_size_no_plan_has_names_the_sizes_there_are(capsys):
    require = ["--require", "placement=colocate", "--require", "generation.devices=8"]
    assert main(["plan", "grpo", *CLUSTER, *require]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "generates on a group of 8 device(s)" in err and "may run on: 16" in err


@pytest.mark.slow
def test_explain_shows_the_constrained_plan_beside_the_unconstrained_winner(capsys):
    assert main(["plan", "grpo", *CLUSTER, "--require", "placement=colocate", "--explain"]) == 0
    text = capsys.readouterr().out
    assert "constrained (placement=colocate):" in text and "unconstrained winner:" in text
    assert "per component (constrained - unconstrained" in text


@pytest.mark.parametrize(
    ("require", "message"),
    [
        ("placement=everywhere", "one of colocate, split, standalone, disaggregated"),
        ("critic.tp=2", "the graph has no model 'critic'"),
        ("actor.tp=zero", "give a whole number >= 1"),
        ("speed=fast", "unknown key 'speed'"),
        ("placement", "write KEY=VALUE"),
        ("generation.tp=3", "no plan for this graph on this cluster has generation tp 3"),
        ("actor.schedule=zigzag", "one of gpipe, 1f1b, interleaved"),
        ("critic.schedule=gpipe", "the graph has no model 'critic'"),
        ("actor.virtual_stages=0", "give a whole number >= 1"),
        ("generation.devices=3", "generates on a group of 3 device(s)"),
        ("generation.devices=none", "give a whole number >= 1"),
    ],
)
def test_bad_requirements_are_named(capsys, require, message):
    assert main(["plan", "grpo", *CLUSTER, "--require", require]) == 2
    assert message in " ".join(capsys.readouterr().err.split())


def test_require_needs_a_cluster(capsys):
    assert main(["plan", "grpo", "--require", "placement=colocate"]) == 2
    assert "add --cluster" in capsys.readouterr().err


@pytest.mark.slow
def test_a_required_pipeline_schedule_holds_in_the_plan_and_explain_prices_it(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    require = [
        "--require",
        "actor.pp=4",
        "--require",
        "actor.schedule=interleaved",
        "--require",
        "actor.virtual_stages=2",
    ]
    assert main(["plan", "grpo", *CLUSTER, *require, "--explain", "--out", str(out)]) == 0
    lay = load_plan(out).layout.layout("actor")
    assert (lay.parallel.pp, lay.schedule, lay.virtual_stages) == (4, "interleaved", 2)
    text = capsys.readouterr().out
    assert "pp4 int2" in text  # the plan summary
    line = next(x for x in text.splitlines() if x.strip().startswith("pipeline actor pp4 int2 (train step)"))
    assert "bubble" in line and "in flight" in line and "7 stage crossing(s)" in line


def test_a_required_schedule_the_models_layers_do_not_allow_names_the_model_and_its_layers(tmp_path, capsys):
    """A 2-layer model cut into pp 2 x 2 interleaved stages: refused, naming the model and why."""
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 64}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    cluster = ["--cluster", "2xA100-80G", "--model", str(tmp_path / "config.json")]
    assert main(["plan", "grpo", *cluster, "--require", "actor.schedule=interleaved"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "model 'actor' (2 decoder layers)" in err and "pp 2 x virtual_stages 2 does not divide the 2 layers" in err
