"""The graphs that need ports, graph state, filters, several policies or an environment learn
their toy tasks (seed 0), each sized to show its curve clearly climbing."""

from __future__ import annotations

import pytest
import yaml

from flowrl import api

pytestmark = pytest.mark.slow


def mean(xs):
    xs = list(xs)
    return sum(xs) / len(xs)


def train(graph: str, tmp_path, steps: int, *extra: str):
    overrides = [f"steps={steps}", "seed=0", "progress=false", f"out={tmp_path}", *extra]
    g, plan = api.plan(graph, overrides=overrides, emit=lambda s: None)
    return api.run(g, plan)


def curve(result, key="reward"):
    values = [m[key] for m in result.metrics]
    return mean(values[:10]), mean(values[-10:])


def test_dapo_learns_with_dynamic_sampling(tmp_path):
    result = train("graphs/dapo.py", tmp_path, 100, "checkpoint=false")  # 0.009 -> 0.54
    first, last = curve(result)
    print(f"DAPO copy: reward {first:.3f} -> {last:.3f}")
    assert last > first + 0.3
    rounds = [m["dynamic_sampling/rounds"] for m in result.metrics]
    assert max(rounds) > 1  # some steps sampled more prompts to fill the batch
    workload = yaml.safe_load((result.out_dir / "plan.yaml").read_text())["target"]["workload"]
    assert 0 < workload["acceptance_rate"] < 1


def test_safe_rlhf_meets_its_cost_budget_and_learns(tmp_path):
    result = train("graphs/safe_rlhf.py", tmp_path, 100, "checkpoint=false")  # reward 0.009 -> 0.15, cost 0.73 -> 0.002
    first, last = curve(result)
    cost_first, cost_last = curve(result, "cost/cost")
    lam = [m["multiplier_step/multiplier"] for m in result.metrics]
    print(
        f"Safe RLHF: reward {first:.3f} -> {last:.3f}, cost {cost_first:.3f} -> {cost_last:.3f}, "
        f"max lambda {max(lam):.3f}"
    )
    assert cost_first > 0.3 and cost_last < 0.05  # the budget
    assert max(lam) > 1.1 and lam[-1] < max(lam)  # the multiplier rose while over budget, then fell
    assert last > first + 0.08


def test_two_policies_learn_from_a_shared_reward(tmp_path):
    result = train("graphs/two_agent.py", tmp_path, 100)  # 0.018 -> 0.22
    first, last = curve(result)
    print(f"two agents: reward {first:.3f} -> {last:.3f}")
    assert last > first + 0.1
    m = result.metrics[-1]
    assert "train_proposer/loss" in m and "train_solver/loss" in m
    assert set(result.checkpoints) == {"proposer", "solver"}
    assert result.checkpoints["proposer"] != result.checkpoints["solver"]


def test_tool_use_learns_to_call_the_calculator(tmp_path):
    result = train("graphs/tool_use.py", tmp_path, 120, "checkpoint=false")  # 0.02 -> 0.3
    first, last = curve(result)
    calls = mean(m["episodes/env_replies"] for m in result.metrics[-10:])
    print(f"tool use: reward {first:.3f} -> {last:.3f}, calculator calls {calls:.2f}")
    assert calls > 0.8
    assert last > first + 0.15
