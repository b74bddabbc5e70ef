"""Issue 21: a train node's epochs and mini-batches are resolved into the plan (`plan.options`),
from `train.epochs` or the node's own option (`--set nodes.train_actor.epochs=4`). The cost model
reads only the workload, derived from `train.epochs`: the same 4 epochs set for the node are run
but not costed (predicted train time and the workload's ppo_epochs as for 1 epoch), so the plan's
prediction, --explain and the tuner's choice are off by the factor."""

from __future__ import annotations

import pytest

from flowrl import api

SMALL = ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=4"]


def planned(*extra: str):
    return api.plan("grpo", overrides=[*SMALL, *extra], emit=lambda s: None)[1]


def test_train_epochs_are_costed() -> None:
    one, four = planned(), planned("train.epochs=4")
    assert four.layout.predicted.breakdown["train_actor"] > 3 * one.layout.predicted.breakdown["train_actor"]


def test_a_train_nodes_own_epochs_are_costed_as_the_configs() -> None:
    by_config, by_node = planned("train.epochs=4"), planned("nodes.train_actor.epochs=4")
    assert by_node.node_options("train_actor").options["epochs"] == 4  # what runs
    assert by_node.layout.predicted.breakdown["train_actor"] == pytest.approx(
        by_config.layout.predicted.breakdown["train_actor"], rel=0.05
    )
