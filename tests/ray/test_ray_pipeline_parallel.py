"""Pipeline-parallel plans on the Ray backend, this machine as two devices (gloo): the actor in pp=2
stages (the torch engine's 1F1B schedule over two Ray workers), generation on the plan's generation
layout (two whole replicas the stages' gathered weights reach after each step): GRPO learns the copy
task, every step reports its pipeline bubble, and a run resumed from a pp=2 checkpoint equals the
uninterrupted run.

One Ray session of two CPUs serves the module.
"""

from __future__ import annotations

import pytest
from helpers import cpu_plan, resumed_after_step_1, untimed

from flowrl import api

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.slow]
SMALL = ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "progress=false"]


def pp2_plan(tmp_path, *extra: str):
    """A colocated cpu:2 plan of grpo with the actor in 2 pipeline stages."""
    return cpu_plan("grpo", [*SMALL, f"out={tmp_path}", *extra], 2, ("actor.pp=2", "placement=colocate"))


def mean(xs):
    return sum(xs) / len(xs)


def test_grpo_learns_the_copy_task_with_the_actor_in_two_pipeline_stages(tmp_path):
    """The default batch (32 prompts x 16 samples) at twice the default learning rate: on one process seed
    0 climbs from 0.015 (first 5 steps) to 0.28 (last 5) in 30 steps, still climbing; pp=2 must climb
    most of that way."""
    g, plan = pp2_plan(tmp_path, "steps=30", "seed=0", "checkpoint=false", "train.lr=4e-3",
                       "rollout.prompts_per_step=32", "rollout.samples_per_prompt=16")  # fmt: skip
    actor = plan.layout.layout("actor")
    assert (actor.parallel.pp, actor.parallel.dp, actor.schedule) == (2, 1, "1f1b")
    # pp > 1 never samples in place: generation has its own replicas
    assert not plan.layout.trains_as_it_generates("actor")
    result = api.run(g, plan)
    m = result.metrics
    rewards = [r["reward"] for r in m]
    first, last = mean(rewards[:5]), mean(rewards[-5:])
    print(f"GRPO copy, Ray pp=2: reward {first:.3f} -> {last:.3f}")
    assert last > first + 0.15, rewards
    assert all(0.0 <= r["train_actor/pp_bubble"] < 1.0 for r in m)  # measured on every step
    assert m[0]["logprob_gap"] < 1e-4  # the first batch: replicas and stages hold the same weights


def test_a_resumed_pp2_run_equals_the_uninterrupted_run(tmp_path):
    g, plan = pp2_plan(tmp_path, "steps=4", "save_every=2", "checkpoint=true")
    whole, resumed = resumed_after_step_1(g, plan, tmp_path)
    assert resumed.resumed_from == 2
    again = untimed(resumed.metrics)
    assert [r["step"] for r in again] == [0, 1, 2, 3] and untimed(whole.metrics) == again
