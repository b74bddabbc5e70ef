"""Issue 21: a filter with by_row=True may keep no row, and the train node then skips its step
(``train_actor/empty``): the model's weight version does not advance. The pipeline still counts one
version per step (``version0 + step``), so every later rollout is reported one version stale. In a
sync run (staleness 0 by definition) the rollout then reports ``staleness_max`` 1,
``staleness_mean`` 1.0 and ``staleness_0`` 0.0 although it sampled with the weights it trains."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from flowrl import api
from flowrl.runtime.executor import run_dir

GRAPH = '''
from flowrl import register
from flowrl.graph import Graph

CALLS = [0]


@register.filter("none_then_all", needs=("rewards",))
def none_then_all(inputs, algo):
    """Keeps no row on its first call (the train step is skipped), every row afterwards."""
    import torch

    CALLS[0] += 1
    return torch.full((len(inputs["rewards"]),), CALLS[0] > 1, dtype=torch.bool)


def build(cfg):
    g = Graph("empty_first")
    g.model("actor", "actor")
    g.generate("rollout", model="actor", reads="prompts", writes="responses", n=cfg.rollout.samples_per_prompt)
    g.reward("reward", fn="task", reads="prompts responses", writes="rewards")
    g.filter("select", fn="none_then_all", reads="rewards responses", by_row=True)
    g.train("train_actor", model="actor", loss="sft", reads="responses")
    return g
'''

SMALL = [
    "rollout.prompts_per_step=2",
    "rollout.samples_per_prompt=2",
    "rollout.max_new_tokens=2",
    "train.mini_batches=1",
    "rollout.mode=sync",
    "progress=false",
    "checkpoint=false",
]


def test_a_skipped_train_step_does_not_make_a_sync_rollout_stale(tmp_path: Path) -> None:
    source = tmp_path / "empty_first.py"
    source.write_text(textwrap.dedent(GRAPH))
    graph, plan = api.plan(str(source), overrides=SMALL, flags={"steps": 3}, emit=lambda s: None)
    out = api.run(graph, plan, out_dir=run_dir(str(tmp_path), "run")).out_dir
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["train_actor/empty"] == 1 and "train_actor/loss" in rows[1]  # step 0 skipped, then trained
    for row in rows:
        assert row["rollout/staleness_max"] == 0, row
        assert row["rollout/staleness_0"] in (0.0, 1.0)  # every kept sample fresh (0.0: none kept)
        if row["step"] > 0:
            assert row["rollout/staleness_0"] == 1.0, row
