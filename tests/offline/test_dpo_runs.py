"""graphs/dpo.py end to end on the tiny model: a train-only plan with the reference's forward and no
generation, held-out preference accuracy rises, a resumed run equals the uninterrupted one, and a
user's preference file (renamed columns, a held-out file) trains."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import metrics_rows, resumed_after_step_1, untimed

from flowrl import api
from flowrl.runtime.schedule import lower

SMALL = ["progress=false", "rollout.prompts_per_step=8"]


def test_the_dpo_plan_scores_the_pairs_with_the_reference_once_and_generates_nothing():
    graph, plan = api.plan("graphs/dpo.py", overrides=SMALL, emit=lambda s: None)
    schedule = lower(graph, plan)
    assert [t.kind for t in schedule.tasks] == ["source", "forward", "train"]
    assert all(m.generation_group is None for m in schedule.models)
    assert graph.nodes["ref_logprobs"].model == "ref" and graph.models["ref"].init_from == "actor"
    assert plan.options["train_actor"].options["beta"] == 0.1
    assert {n.node: n.rows for n in plan.nodes} == {"data": 16, "ref_logprobs": 16, "train_actor": 16}  # 8 pairs


@pytest.mark.slow
def test_a_cluster_forecast_of_dpo_places_the_reference_beside_the_actor_and_no_generation(tmp_path, capsys):
    from flowrl.cli import main
    from flowrl.contract.plan import load_plan

    out = tmp_path / "plan.yaml"
    code = main(["plan", "graphs/dpo.py", "--cluster", "8xA100-80G", "--model", "llama-7b", "--out", str(out),
                 "--budget", "1"])  # fmt: skip
    assert code == 0
    plan = load_plan(out)
    assert [n.kind for n in plan.nodes] == ["source", "forward", "train"]
    assert {m.model for m in plan.layout.models} >= {"actor", "ref"}
    assert all(e.required_bytes <= e.capacity_bytes for e in plan.memory)


@pytest.mark.slow
def test_dpo_on_the_built_in_task_raises_held_out_preference_accuracy(tmp_path):
    graph, plan = api.plan(
        "graphs/dpo.py", overrides=[*SMALL, "eval.every=10", "checkpoint=false"], flags={"steps": 20},
        emit=lambda s: None,
    )  # fmt: skip
    result = api.run(graph, plan, out_dir=tmp_path / "run")
    accuracy = [e["eval/preference_accuracy"] for e in result.evals]
    margins = [e["eval/margin"] for e in result.evals]
    assert accuracy[0] == 0.0 and margins[0] == 0.0  # the policy is its reference before training
    assert accuracy[-1] >= 0.7 and margins[-1] > margins[1] > 0
    assert result.evals[-1]["eval/reward_chosen"] > result.evals[-1]["eval/reward_rejected"]
    rows = metrics_rows(tmp_path / "run")
    assert [r["eval/preference_accuracy"] for r in rows if r.get("kind") == "eval"] == accuracy
    assert all(r["tokens"] == 0 and "train_actor/margin" in r for r in rows if "kind" not in r)
    assert (tmp_path / "run" / "reward.png").is_file()


@pytest.mark.slow
def test_a_resumed_dpo_run_equals_the_uninterrupted_run(tmp_path):
    graph, plan = api.plan("graphs/dpo.py", overrides=[*SMALL, "save_every=2"], flags={"steps": 4}, emit=lambda s: None)
    whole, resumed = resumed_after_step_1(graph, plan, tmp_path)
    assert resumed.resumed_from == 2
    a = untimed([json.loads(x) for x in (whole.out_dir / "metrics.jsonl").read_text().splitlines()])
    b = untimed([json.loads(x) for x in (resumed.out_dir / "metrics.jsonl").read_text().splitlines()])
    assert a == b and a[-1]["prompts_drawn"] > 0 and a[-1]["train_actor/pref_accuracy"] >= 0
    from safetensors.torch import load_file

    wa, wb = (load_file(str(r.out_dir / "checkpoint" / "model.safetensors")) for r in (whole, resumed))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_dpo_trains_on_a_users_preference_file_with_renamed_columns_and_held_out_pairs(tmp_path):
    rows = [{"q": f"{s}>", "good": s, "bad": s[::-1] + "a"} for s in ("ab", "ba", "cab", "d", "dd", "abc", "c", "bd")]
    train, val = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    val.write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
    graph, plan = api.plan(
        "graphs/dpo.py",
        overrides=[*SMALL, f"data.train={train}", f"data.val={val}", "data.prompt_key=q", "data.chosen_key=good",
                   "data.rejected_key=bad", "eval.every=2", "checkpoint=false", "task=data",
                   "nodes.train_actor.beta=0.5", "nodes.train_actor.label_smoothing=0.1"],
        flags={"steps": 2},
        emit=lambda s: None,
    )  # fmt: skip
    result = api.run(graph, plan, out_dir=tmp_path / "run")
    assert [e["eval/pairs"] for e in result.evals] == [3, 3]
    assert result.evals[-1]["eval/margin"] != 0.0
    first = result.metrics[0]
    assert first["data/rows"] == 16 and first["train_actor/loss"] > 0  # 8 prompts, two rows each


@pytest.mark.parametrize("graph", ["graphs/dpo.py", "graphs/sft.py", "graphs/reward_model.py"])
def test_the_explanation_of_a_train_only_plan_says_nothing_of_generation_rollouts_or_weight_sync(graph, capsys):
    from flowrl.cli import main

    code = main(["plan", graph, "--cluster", "8xA100-80G", "--model", "llama-7b", "--budget", "1", "--explain"])
    assert code == 0
    text = capsys.readouterr().out
    assert "winner:" in text and "train" in text
    for word in (" gen ", "rollout", "| sync", "decode", "generation engine", "on-policy", "stale", "target"):
        assert word not in text, word
