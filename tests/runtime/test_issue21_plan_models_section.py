"""Issue 21: `PlanExecutor.check` is "the one place a plan is checked on its way in", before any
model is built. It compares the plan's resolved node options with the graph's nodes, but not its
resolved 'models' with the graph's models: a plan file whose 'models' section lacks a graph model
passes the check and fails only while the workers build the engines ("running grpo ..." is printed
and the actor is built first); one naming a model the graph does not have runs silently (and that
model's engines take part in the capability check)."""

from __future__ import annotations

import pytest

from flowrl import api
from flowrl.errors import FlowRLError

SMALL = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "train.mini_batches=1", "progress=false"]


@pytest.fixture(scope="module")
def planned():
    return api.plan("grpo", overrides=SMALL, flags={"steps": 2}, emit=lambda s: None)


def test_a_plan_missing_a_models_resolved_spec_is_refused_by_the_check(planned) -> None:
    import msgspec

    graph, plan = planned
    models = {k: v for k, v in plan.models.items() if k != "ref"}
    with pytest.raises(FlowRLError, match="ref"):
        api.check(graph, msgspec.structs.replace(plan, models=models).sealed())


def test_a_plan_resolving_a_model_the_graph_lacks_is_refused_by_the_check(planned) -> None:
    import msgspec

    graph, plan = planned
    ghost = msgspec.structs.replace(plan.models["ref"], model="ghost", training_engine="local")
    models = {**plan.models, "ghost": ghost}
    with pytest.raises(FlowRLError, match="ghost"):
        api.check(graph, msgspec.structs.replace(plan, models=models).sealed())
