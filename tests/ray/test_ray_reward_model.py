"""graphs/reward_model.py on the Ray backend (this machine as two devices, the reward model data parallel
over both): each rank takes whole preference pairs, and the model learns to rank them."""

from __future__ import annotations

import pytest
from helpers import pairs_registry

from flowrl import api

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.slow]


def test_a_reward_model_trains_data_parallel_on_ray_workers(tmp_path):
    from flowrl.planner.constraints import parse_requirements

    reg = pairs_registry(entry_points=True)
    overrides = ["progress=false", "checkpoint=false", "steps=6", "rollout.prompts_per_step=8", "task=copy_pairs",
                 "train.lr=1e-3", "backend=ray", "device=cpu"]  # fmt: skip
    g, cfg = api.load("graphs/reward_model.py", registry=reg, overrides=overrides)
    target = api.local_target(cfg, reg, devices=2)
    graph, plan = api.plan(
        "graphs/reward_model.py", registry=reg, overrides=overrides, target=target, for_backend=True,
        options={"require": parse_requirements(["rm.dp=2"], list(g.models))}, emit=lambda s: None,
    )  # fmt: skip
    assert plan.config.executor == "ray" and [n.kind for n in plan.nodes] == ["source", "train"]
    result = api.run(graph, plan, registry=reg, out_dir=tmp_path / "run")
    accuracy = [m["train_rm/accuracy"] for m in result.metrics]
    loss = [m["train_rm/loss"] for m in result.metrics]
    assert len(accuracy) == 6 and sum(loss[-2:]) < sum(loss[:2])
