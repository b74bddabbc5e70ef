"""`flowrl plan --require KEY=VALUE`: the tuner searches only plans that satisfy the constraints,
and --explain sets the best constrained plan beside the unconstrained winner."""

from __future__ import annotations

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
    ],
)
def test_bad_requirements_are_named(capsys, require, message):
    assert main(["plan", "grpo", *CLUSTER, "--require", require]) == 2
    assert message in " ".join(capsys.readouterr().err.split())


def test_require_needs_a_cluster(capsys):
    assert main(["plan", "grpo", "--require", "placement=colocate"]) == 2
    assert "add --cluster" in capsys.readouterr().err
