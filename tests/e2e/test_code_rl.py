"""Code RL learns from the sandboxed tests (graphs/code_rl.py): every response runs in bubblewrap, a
group's repeated answer once, by two reward workers. The longest whole run of the suite, in a module
of its own so that `pytest -n 2` schedules it beside the other learning runs, not after them."""

from __future__ import annotations

import pytest
from helpers import ONE_LAYER, curve

pytestmark = pytest.mark.slow


def test_code_rl_learns_from_the_sandboxed_tests(train):
    # 8 prompts a step: every response runs in bubblewrap (a group's repeats once), two reward workers. Seed 0
    # takes off at step ~26: 35 steps climb 0.001 -> 0.158 (40 steps: 0.221), sandbox runs a step 64 -> 17
    result = train("graphs/code_rl.py", 35, "checkpoint=false", ONE_LAYER, "rollout.prompts_per_step=8")
    first, last = curve(result)
    runs = [m["reward/sandbox_runs"] for m in result.metrics]
    print(f"code RL: reward {first:.3f} -> {last:.3f}, sandbox runs a step {runs[0]} -> {runs[-1]}")
    assert last > first + 0.1
    assert runs[-1] < runs[0]  # answers converge: a group's repeated answer runs once
