"""Metrics belong to nodes: every shipped graph logs `reward`, `kl` where it has a reference
model, and response length, whatever node produces them."""

from __future__ import annotations

import json

import pytest

from flowrl import api
from flowrl.plugins.builtin import BUILTIN_GRAPHS

TINY = [
    "steps=2",
    "seed=0",
    "progress=false",
    "checkpoint=false",
    "rollout.prompts_per_step=2",
    "rollout.samples_per_prompt=2",
]


@pytest.mark.parametrize(
    "graph", [g if g in ("grpo", "ppo") else pytest.param(g, marks=pytest.mark.slow) for g in BUILTIN_GRAPHS]
)
def test_every_shipped_graph_logs_reward_kl_and_length(graph, tmp_path):
    g, plan = api.plan(graph, overrides=[*TINY, f"out={tmp_path}"], emit=lambda s: None)
    result = api.run(g, plan)
    records = [json.loads(line) for line in (result.out_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2
    has_ref = any(d.role == "reference" for d in g.models.values())
    for record in records:
        assert isinstance(record["reward"], float), record
        assert record["response_length"] > 0
        assert ("kl" in record) == has_ref
        if has_ref:
            assert record["kl"] >= 0  # a k3 estimate
        assert record["tokens"] > 0 and set(record["spans"]) == set(g.nodes)
        # every metric but the run-level ones is prefixed by the node that reported it
        for key in record:
            if "/" in key:
                assert key.split("/")[0] in g.nodes


def test_a_reward_model_graph_logs_its_scores_as_reward(tmp_path):
    g, plan = api.plan("ppo_rm", overrides=[*TINY, f"out={tmp_path}"], emit=lambda s: None)
    record = api.run(g, plan).metrics[-1]
    assert record["reward"] == record["score/reward"]


def test_task_reward_reports_exact_and_train_nodes_their_stats(tmp_path):
    g, plan = api.plan("grpo", overrides=[*TINY, f"out={tmp_path}"], emit=lambda s: None)
    record = api.run(g, plan).metrics[-1]
    assert 0.0 <= record["reward/exact"] <= 1.0
    assert {"train_actor/loss", "train_actor/grad_norm", "train_actor/kl", "train_actor/clipfrac"} <= set(record)
    assert record["kl"] == record["train_actor/kl"]
