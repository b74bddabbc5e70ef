"""graphs/reward_model.py on the Ray backend (this machine as two devices, the reward model data parallel
over both) on the built-in task's preference pairs: each rank takes whole pairs, and the model learns
to rank them."""

from __future__ import annotations

import pytest
from helpers import cpu_plan

from flowrl import api

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.slow]


def test_a_reward_model_trains_data_parallel_on_ray_workers(tmp_path):
    overrides = ["progress=false", "checkpoint=false", "steps=6", "rollout.prompts_per_step=8", "train.lr=1e-3"]
    graph, plan = cpu_plan("graphs/reward_model.py", overrides, 2, require=("rm.dp=2",))
    assert plan.config.executor == "ray" and [n.kind for n in plan.nodes] == ["source", "train"]
    result = api.run(graph, plan, out_dir=tmp_path / "run")
    accuracy = [m["train_rm/pref_accuracy"] for m in result.metrics]
    loss = [m["train_rm/loss"] for m in result.metrics]
    assert len(accuracy) == 6 and sum(loss[-2:]) < sum(loss[:2])
