"""A filter with by_row=True may keep no row: the train node then skips its step
(``train_actor/empty``), the nodes between the filter and the train node (forward nodes computing old
or reference log-probs) skip alike instead of failing in the engine, and the skipped step does not
advance the model's weight version, so a sync run's rollouts stay fresh."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from helpers import SMALL_RUN

from flowrl import api
from flowrl.runtime.executor import run_dir

SMALL = [*SMALL_RUN, "checkpoint=false"]

NOTHING_KEPT = """
from flowrl.graph import Graph


def build(cfg):
    g = Graph("row_grpo")
    g.model("actor", "actor")
    g.model("ref", "reference", init_from="actor")
    g.generate("rollout", model="actor", reads="prompts", writes="responses", n=cfg.rollout.samples_per_prompt)
    g.reward("reward", fn="task", reads="prompts responses", writes="rewards")
    # min_reward above any reward: no row is kept
    g.filter("select", fn="threshold", reads="rewards responses", by_row=True, min_reward=2.0)
    g.forward("old_logprobs", model="actor", output="logprobs", reads="responses", writes="old_logprobs")
    g.forward("ref_logprobs", model="ref", output="logprobs", reads="responses", writes="ref_logprobs")
    g.compute("advantages", fn="grpo", reads="rewards responses", writes="advantages")
    g.train("train_actor", model="actor", loss="ppo", reads="responses old_logprobs ref_logprobs advantages")
    return g
"""

NOTHING_THEN_ALL = '''
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


def run_graph(tmp_path: Path, name: str, source: str, steps: int, *extra: str) -> list[dict]:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    graph, plan = api.plan(str(path), overrides=[*SMALL, *extra], flags={"steps": steps}, emit=lambda s: None)
    out = api.run(graph, plan, out_dir=run_dir(str(tmp_path), "run")).out_dir
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_forward_nodes_after_a_row_filter_that_kept_nothing_skip_like_the_train_node(tmp_path: Path) -> None:
    rows = run_graph(tmp_path, "row_grpo", NOTHING_KEPT, 1)
    assert rows[0]["train_actor/empty"] == 1


def test_a_skipped_train_step_does_not_make_a_sync_rollout_stale(tmp_path: Path) -> None:
    rows = run_graph(tmp_path, "empty_first", NOTHING_THEN_ALL, 3, "rollout.mode=sync")
    assert rows[0]["train_actor/empty"] == 1 and "train_actor/loss" in rows[1]  # step 0 skipped, then trained
    for row in rows:
        assert row["rollout/staleness_max"] == 0, row
        assert row["rollout/staleness_0"] in (0.0, 1.0)  # every kept sample fresh (0.0: none kept)
        if row["step"] > 0:
            assert row["rollout/staleness_0"] == 1.0, row
