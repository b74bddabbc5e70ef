"""graphs/dpo.py on the Ray backend (this machine as two devices): the pairs read on the controller,
the reference's log-probs and the pair loss on Ray workers (each pair kept in one micro-batch of
one rank), and the preference margin grows."""

from __future__ import annotations

import pytest
from helpers import cpu_plan

from flowrl import api

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.slow]


def test_dpo_runs_on_ray_workers_and_its_margin_grows(tmp_path):
    graph, plan = cpu_plan(
        "graphs/dpo.py", ["progress=false", "checkpoint=false", "steps=6", "rollout.prompts_per_step=8"], 2
    )
    assert plan.config.executor == "ray" and [n.kind for n in plan.nodes] == ["source", "forward", "train"]
    result = api.run(graph, plan, out_dir=tmp_path / "run")
    margins = [m["train_actor/margin"] for m in result.metrics]
    assert len(margins) == 6 and margins[-1] > margins[0]
