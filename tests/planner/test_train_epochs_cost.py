"""A train node's epochs are costed as they run: from `train.epochs` or from the node's own option
(`--set nodes.train_actor.epochs=4`), resolved into the plan (`plan.options`), the predicted train
time grows with them, so the plan's prediction, --explain and the tuner's choice see them."""

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
