"""graphs/sft.py on the Ray backend (this machine as two devices): a train-only plan runs on Ray
workers, its source reading the data on the controller, and learns."""

from __future__ import annotations

import pytest
from helpers import cpu_plan

from flowrl import api

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.slow]


def test_sft_runs_on_ray_workers_and_its_loss_falls(tmp_path):
    graph, plan = cpu_plan(
        "graphs/sft.py", ["progress=false", "checkpoint=false", "steps=6", "rollout.prompts_per_step=8"], 2
    )
    assert plan.config.executor == "ray" and [n.kind for n in plan.nodes] == ["source", "train"]
    result = api.run(graph, plan, out_dir=tmp_path / "run")
    nll = [m["train_actor/nll"] for m in result.metrics]
    assert len(nll) == 6 and nll[-1] < nll[0]
