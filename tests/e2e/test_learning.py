"""Whole runs: the shipped graphs really learn the toy task with a fixed seed.

These are the heaviest tests (marked slow: the full suite runs them, the quick lane does not),
each sized to what it must show: a run long enough for its curve to have clearly climbed, with
the numbers of seed 0 noted beside it (one torch thread, as tests/conftest.py sets). The learning
rate is constant, so a shorter run is the first steps of a longer one.
"""

from __future__ import annotations

from statistics import mean

import pytest

pytestmark = pytest.mark.slow


def test_ppo_learns(train):
    result = train("graphs/ppo.py", 90, "checkpoint=false")  # 0.012 -> 0.36 (last 10) with seed 0
    rewards = [m["reward"] for m in result.metrics]
    first, last = mean(rewards[:10]), mean(rewards[-10:])
    print(f"PPO copy: reward {first:.3f} -> {last:.3f}")
    assert last > first + 0.2
    assert "train_critic/loss" in result.metrics[-1]


# each past first + 0.1 with room at these lengths (two torch threads, seed 0: rloo 0.016 -> 0.33,
# remax 0.015 -> 0.28, reinforce_pp 0.014 -> 0.27)
@pytest.mark.parametrize(("graph", "steps"), [("rloo", 45), ("remax", 50), ("reinforce_pp", 70)])
def test_other_graphs_run_and_improve(graph, steps, train):
    result = train(graph, steps, "checkpoint=false")
    rewards = [m["reward"] for m in result.metrics]
    assert mean(rewards[-10:]) > mean(rewards[:10]) + 0.1, rewards


def test_grpo_learns_the_long_tail_repeat_task(train):
    result = train("grpo", 50, "task=repeat", "checkpoint=false")  # 0.01 -> 0.69
    rewards = [m["reward"] for m in result.metrics]
    first, last = mean(rewards[:10]), mean(rewards[-10:])
    print(f"GRPO repeat: reward {first:.3f} -> {last:.3f}")
    assert first < 0.2 and last > 0.6
