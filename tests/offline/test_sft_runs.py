"""graphs/sft.py end to end on the tiny model: a train-only plan (no generation, no weight sync),
the held-out loss falls, a resumed run equals the uninterrupted one, and users' files train."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import resumed_after_step_1, untimed

from flowrl import api
from flowrl.cli import main
from flowrl.contract.layout import RolloutPolicy
from flowrl.contract.plan import load_plan
from flowrl.runtime.schedule import lower

SMALL = ["progress=false", "rollout.prompts_per_step=8"]


def test_the_sft_plan_has_no_generation_and_no_weight_sync():
    graph, plan = api.plan("graphs/sft.py", overrides=SMALL, emit=lambda s: None)
    schedule = lower(graph, plan)
    assert [t.kind for t in schedule.tasks] == ["source", "train"]
    assert schedule.tasks[0].groups == ()  # the data is read on the controller
    assert all(m.generation_group is None for m in schedule.models)
    assert [n.kind for n in plan.nodes] == ["source", "train"]


def test_a_cluster_forecast_of_sft_plans_the_train_stage_only(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    code = main(["plan", "graphs/sft.py", "--cluster", "8xA100-80G", "--model", "llama-7b", "--out", str(out),
                 "--budget", "1", "--explain"])  # fmt: skip
    assert code == 0
    text = capsys.readouterr().out
    assert "train_actor" in text and "weight_sync" not in text
    plan = load_plan(out)
    assert [n.kind for n in plan.nodes] == ["source", "train"]
    assert plan.layout.rollout == RolloutPolicy()  # nothing generates: no policy chosen
    peaks = " ".join(k for e in plan.memory for k in e.breakdown)
    assert "generation" not in peaks and "KV cache" not in peaks  # the train stage's memory only
    assert all(e.required_bytes <= e.capacity_bytes for e in plan.memory)


@pytest.mark.slow
def test_sft_on_the_built_in_task_lowers_the_held_out_loss(tmp_path):
    graph, plan = api.plan(
        "graphs/sft.py", overrides=[*SMALL, "eval.every=10", "checkpoint=false"], flags={"steps": 30},
        emit=lambda s: None,
    )  # fmt: skip
    result = api.run(graph, plan, out_dir=tmp_path / "run")
    losses = [e["eval/loss"] for e in result.evals]
    assert len(losses) == 4 and losses[-1] < 0.5 * losses[0]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["eval/loss"] for r in rows if r.get("kind") == "eval"] == losses
    assert all("tokens" in r and r["tokens"] == 0 for r in rows if "kind" not in r)  # nothing generated


@pytest.mark.slow
def test_a_resumed_sft_run_equals_the_uninterrupted_run(tmp_path):
    graph, plan = api.plan("graphs/sft.py", overrides=[*SMALL, "save_every=2"], flags={"steps": 4}, emit=lambda s: None)
    whole, resumed = resumed_after_step_1(graph, plan, tmp_path)
    assert resumed.resumed_from == 2
    a = untimed([json.loads(x) for x in (whole.out_dir / "metrics.jsonl").read_text().splitlines()])
    b = untimed([json.loads(x) for x in (resumed.out_dir / "metrics.jsonl").read_text().splitlines()])
    assert a == b and a[-1]["prompts_drawn"] > 0
    from safetensors.torch import load_file

    wa, wb = (load_file(str(r.out_dir / "checkpoint" / "model.safetensors")) for r in (whole, resumed))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_sft_trains_on_a_users_file_with_renamed_columns_and_a_held_out_file(tmp_path):
    rows = [{"q": f"{s}>", "a": s} for s in ("ab", "ba", "cab", "d", "dd", "abc", "c", "bd")]
    train, val = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    val.write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
    graph, plan = api.plan(
        "graphs/sft.py",
        overrides=[*SMALL, f"data.train={train}", f"data.val={val}", "data.prompt_key=q", "data.response_key=a",
                   "eval.every=2", "checkpoint=false", "task=data"],
        flags={"steps": 2},
        emit=lambda s: None,
    )  # fmt: skip
    result = api.run(graph, plan, out_dir=tmp_path / "run")
    assert [e["eval/tokens"] for e in result.evals] == [2 + 2 + 3 + 3] * 2  # the 3 held-out responses + end tokens
    assert result.metrics[0]["data/rows"] == 8 and result.metrics[0]["train_actor/nll"] > 0


@pytest.mark.slow
def test_packed_sft_computes_the_same_first_loss_as_padded_sft(tmp_path):
    first = {}
    for pack in ("false", "true"):
        graph, plan = api.plan(
            "graphs/sft.py", overrides=[*SMALL, "checkpoint=false", f"train.pack={pack}", "train.dtype=float32"],
            flags={"steps": 1}, emit=lambda s: None,
        )  # fmt: skip
        step = api.run(graph, plan, out_dir=tmp_path / pack).metrics[0]
        first[pack] = step
    assert first["true"]["train_actor/pad_frac"] == 0.0 < first["false"]["train_actor/pad_frac"]
    assert first["true"]["train_actor/nll"] == pytest.approx(first["false"]["train_actor/nll"], rel=1e-4)


@pytest.mark.parametrize("setting", ["rollout.samples_per_prompt=4", "rollout.temperature=0.7", "rollout.mode=async"])
@pytest.mark.parametrize("graph", ["graphs/sft.py", "graphs/dpo.py"])
def test_a_generation_setting_on_a_graph_that_generates_nothing_is_named_as_without_effect(graph, setting):
    from flowrl.planner.passes.resolve import unused_generation_settings

    g, plan = api.plan(graph, overrides=[*SMALL, setting], flags={"steps": 1}, emit=lambda s: None)
    (warning,) = unused_generation_settings(g, plan.config)
    assert setting.split("=")[0] in warning and "generates nothing" in warning and "no effect" in warning
    g, plan = api.plan(graph, overrides=SMALL, flags={"steps": 1}, emit=lambda s: None)
    assert unused_generation_settings(g, plan.config) == []


def test_the_summary_of_a_run_that_generates_nothing_lists_no_empty_samples_file(tmp_path, capsys):
    args = ["run", "graphs/sft.py", "--steps", "1", "--out", str(tmp_path), "--set", "eval.every=1"]
    assert main([*args, *(x for s in ["rollout.prompts_per_step=8"] for x in ("--set", s))]) == 0
    out = capsys.readouterr().out
    assert "evaluation: after 0 -> 1 steps: loss" in out and "metrics:" in out
    assert "samples:" not in out  # the held-out loss generates no samples to look at


def test_the_workload_of_a_graph_that_generates_nothing_is_one_sample_per_prompt():
    for graph in ("graphs/sft.py", "graphs/dpo.py"):
        _, plan = api.plan(graph, overrides=SMALL, flags={"steps": 1}, emit=lambda s: None)
        assert plan.target.workload.prompts_per_step == 8
        assert plan.target.workload.samples_per_prompt == 1  # not rollout.samples_per_prompt: nothing is sampled
