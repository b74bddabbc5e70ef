"""Whole runs of the environment-hub graphs on the one-layer tiny model: a verifiers environment's rubric
and an OpenEnv environment's rewards, returned by their agents through the run's endpoint, teach it (slow;
4 prompts x 8 episodes a step at train.lr=4e-3, seed 0; docs/guides/environment-hubs.md has the numbers)."""

from __future__ import annotations

import pytest
from helpers import ONE_LAYER, curve, needs

pytestmark = [pytest.mark.slow, needs("verifiers.v1", "openenv.core")]

SMALL = (ONE_LAYER, "checkpoint=false", "rollout.prompts_per_step=4", "train.lr=4e-3")


def test_verifiers_rubric_reward_teaches_reversal(train):
    result = train("graphs/verifiers_env.py", 30, *SMALL)  # 0.040 -> 0.153, 0.158 (two runs; 40 steps: 0.169)
    first, last = curve(result)
    print(f"verifiers vf_reverse: reward {first:.3f} -> {last:.3f}")
    assert all(m["episodes/agent_errors"] == 0 for m in result.metrics)
    assert last > first + 0.05


def test_openenv_environment_reward_teaches_echo(train):
    result = train("graphs/openenv_env.py", 40, *SMALL)  # 0.015 -> 0.171 and 0.088 (agent runs vary run to run)
    first, last = curve(result)
    print(f"openenv echo: reward {first:.3f} -> {last:.3f}")
    assert all(m["episodes/agent_errors"] == 0 for m in result.metrics)
    assert last > first + 0.05
