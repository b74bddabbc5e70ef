"""Whole runs: the shipped graphs really learn the toy task with a fixed seed.

These are the heaviest tests (marked slow: the full suite runs them, the quick lane does not),
each sized to what it must show: a run long enough for its curve to have clearly climbed, with
the numbers of seed 0 noted beside it (one torch thread, as tests/conftest.py sets). The learning
rate is constant, so a shorter run is the first steps of a longer one. They train a one-layer tiny
model (``ONE_LAYER``): its steps are a third faster than the default two layers' and its curves
climb as soon or sooner.
"""

from __future__ import annotations

from statistics import mean

import pytest
from helpers import ONE_LAYER

pytestmark = pytest.mark.slow


def test_ppo_learns(train):
    result = train("graphs/ppo.py", 80, "checkpoint=false", ONE_LAYER)  # 0.008 -> 0.34 (last 10) with seed 0
    rewards = [m["reward"] for m in result.metrics]
    first, last = mean(rewards[:10]), mean(rewards[-10:])
    print(f"PPO copy: reward {first:.3f} -> {last:.3f}")
    assert last > first + 0.2
    assert "train_critic/loss" in result.metrics[-1]


# each past first + 0.1 with room at these lengths (seed 0: rloo 0.016 -> 0.25, remax 0.018 -> 0.21,
# reinforce_pp 0.014 -> 0.20)
@pytest.mark.parametrize(("graph", "steps"), [("rloo", 35), ("remax", 35), ("reinforce_pp", 55)])
def test_other_graphs_run_and_improve(graph, steps, train):
    result = train(graph, steps, "checkpoint=false", ONE_LAYER)
    rewards = [m["reward"] for m in result.metrics]
    assert mean(rewards[-10:]) > mean(rewards[:10]) + 0.1, rewards


def test_grpo_learns_the_long_tail_repeat_task(train):
    result = train("grpo", 35, "task=repeat", "checkpoint=false", ONE_LAYER)  # 0.008 -> 0.54
    rewards = [m["reward"] for m in result.metrics]
    first, last = mean(rewards[:10]), mean(rewards[-10:])
    print(f"GRPO repeat: reward {first:.3f} -> {last:.3f}")
    assert first < 0.2 and last > 0.35
