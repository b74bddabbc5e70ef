"""Whole runs: the shipped graphs really learn the toy task with a fixed seed.

These are the heaviest tests (marked slow: the full suite runs them, the quick lane does not),
each sized to what it must show: a run long enough for its curve to have clearly climbed, with
the numbers of seed 0 noted beside it (one torch thread, as tests/conftest.py sets). The learning
rate is constant, so a shorter run is the first steps of a longer one.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
import yaml

from flowrl import api
from flowrl.backends.local.models import build_causal_lm, load_tokenizer, model_config
from flowrl.specs import TinyModelConfig
from flowrl.tasks.builtin import Copy

pytestmark = pytest.mark.slow


def mean(xs):
    xs = list(xs)
    return sum(xs) / len(xs)


def train(graph: str, tmp_path, steps: int, *extra: str):
    overrides = [f"steps={steps}", "seed=0", "progress=false", f"out={tmp_path}", *extra]
    g, plan = api.plan(graph, overrides=overrides, emit=lambda s: None)
    return api.run(g, plan)


def test_main_job_grpo_learns_copy_and_writes_a_loadable_checkpoint(tmp_path):
    """The README's main job with its defaults, for its first 240 steps: reward from < 0.2 to > 0.8
    (seed 0: 0.026 -> 0.94; about 0.8 from step 120 on)."""
    overrides = ["steps=240", "progress=false", f"out={tmp_path}"]
    g, plan = api.plan("graphs/grpo.py", overrides=overrides, emit=lambda s: None)
    result = api.run(g, plan)
    rewards = [m["reward"] for m in result.metrics]
    first, last = mean(rewards[:10]), mean(rewards[-10:])
    print(f"GRPO copy, {len(rewards)} steps: reward {first:.3f} -> {last:.3f}")
    assert first < 0.2
    assert last > 0.8
    lines = (result.out_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == plan.config.steps and json.loads(lines[-1])["step"] == plan.config.steps - 1
    assert (result.out_dir / "reward.png").read_bytes()[:4] == b"\x89PNG"
    # The checkpoint is the trained policy: greedy decoding from the reloaded files copies.
    ckpt = result.checkpoints["actor"]
    tok = load_tokenizer(str(ckpt))
    model = build_causal_lm(str(ckpt), model_config(str(ckpt), TinyModelConfig(), tok), seed=0)
    task = Copy()
    prompts = task.prompts(random.Random(123), 16)
    enc = tok([p.text for p in prompts], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(
            **enc,
            max_new_tokens=task.max_new_tokens(),
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    greedy = mean(task.score(p, t) for p, t in zip(prompts, texts))
    print(f"reloaded checkpoint, greedy: {greedy:.3f}")
    assert greedy > 0.6


def test_same_seed_same_curve(tmp_path):
    a = train("grpo", tmp_path / "a", 4, "rollout.prompts_per_step=4", "checkpoint=false")
    b = train("grpo", tmp_path / "b", 4, "rollout.prompts_per_step=4", "checkpoint=false")
    assert [m["reward"] for m in a.metrics] == [m["reward"] for m in b.metrics]
    assert [m["train_actor/loss"] for m in a.metrics] == [m["train_actor/loss"] for m in b.metrics]


def test_ppo_learns(tmp_path):
    result = train("graphs/ppo.py", tmp_path, 90, "checkpoint=false")  # 0.012 -> 0.36 (last 10) with seed 0
    rewards = [m["reward"] for m in result.metrics]
    first, last = mean(rewards[:10]), mean(rewards[-10:])
    print(f"PPO copy: reward {first:.3f} -> {last:.3f}")
    assert last > first + 0.2
    assert "train_critic/loss" in result.metrics[-1]


# each past first + 0.1 with room at these lengths (two torch threads, seed 0: rloo 0.016 -> 0.33,
# remax 0.015 -> 0.28, reinforce_pp 0.014 -> 0.27)
@pytest.mark.parametrize(("graph", "steps"), [("rloo", 45), ("remax", 50), ("reinforce_pp", 70)])
def test_other_graphs_run_and_improve(graph, steps, tmp_path):
    result = train(graph, tmp_path, steps, "checkpoint=false")
    rewards = [m["reward"] for m in result.metrics]
    assert mean(rewards[-10:]) > mean(rewards[:10]) + 0.1, rewards


def test_grpo_learns_the_long_tail_repeat_task(tmp_path):
    result = train("grpo", tmp_path, 50, "task=repeat", "checkpoint=false")  # 0.01 -> 0.69
    rewards = [m["reward"] for m in result.metrics]
    first, last = mean(rewards[:10]), mean(rewards[-10:])
    print(f"GRPO repeat: reward {first:.3f} -> {last:.3f}")
    assert first < 0.2 and last > 0.6


# ---------------------------------------------------------------- ports, state, filters, policies, episodes


def curve(result, key="reward"):
    values = [m[key] for m in result.metrics]
    return mean(values[:10]), mean(values[-10:])


def test_dapo_learns_with_dynamic_sampling(tmp_path):
    result = train("graphs/dapo.py", tmp_path, 70, "checkpoint=false")  # 0.009 -> 0.53
    first, last = curve(result)
    print(f"DAPO copy: reward {first:.3f} -> {last:.3f}")
    assert last > first + 0.3
    rounds = [m["dynamic_sampling/rounds"] for m in result.metrics]
    assert max(rounds) > 1  # some steps sampled more prompts to fill the batch
    workload = yaml.safe_load((result.out_dir / "plan.yaml").read_text())["target"]["workload"]
    assert 0 < workload["acceptance_rate"] < 1


def test_safe_rlhf_meets_its_cost_budget_and_learns(tmp_path):
    result = train("graphs/safe_rlhf.py", tmp_path, 100, "checkpoint=false")  # reward 0.009 -> 0.15, cost 0.73 -> 0.003
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
    result = train("graphs/two_agent.py", tmp_path, 50)  # 0.018 -> 0.19
    first, last = curve(result)
    print(f"two agents: reward {first:.3f} -> {last:.3f}")
    assert last > first + 0.1
    m = result.metrics[-1]
    assert "train_proposer/loss" in m and "train_solver/loss" in m
    assert set(result.checkpoints) == {"proposer", "solver"}
    assert result.checkpoints["proposer"] != result.checkpoints["solver"]


def test_tool_use_learns_to_call_the_calculator(tmp_path):
    result = train("graphs/tool_use.py", tmp_path, 60, "checkpoint=false")  # 0.019 -> 0.15, calls 0.45 -> 0.95
    first, last = curve(result)
    calls = mean(m["episodes/env_replies"] for m in result.metrics[-10:])
    print(f"tool use: reward {first:.3f} -> {last:.3f}, calculator calls {calls:.2f}")
    assert calls > 0.8
    assert last > first + 0.08
