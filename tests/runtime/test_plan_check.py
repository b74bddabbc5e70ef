"""`api.check` (`PlanExecutor.check`), the one place a plan is checked on its way in, before any model
is built: a plan whose config was edited after `resolve` wrote its 'models' and 'options' sections is
refused naming the edited field (README: "delete the 'id' line to accept the edit"), never run with
the resolved values while the config says otherwise; a plan whose 'models' section lacks a graph
model, or resolves a model the graph does not have, is refused naming that model."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from flowrl import api
from flowrl.errors import FlowRLError

SMALL = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "train.mini_batches=1", "progress=false"]


@pytest.fixture(scope="module")
def planned():
    return api.plan("grpo", overrides=SMALL, flags={"steps": 2}, emit=lambda s: None)


def edited(plan: Any, section: str, **change: Any) -> Any:
    """``plan`` with its config edited in ``section`` (None: the config itself), as a user editing a
    plan file and deleting its id line would leave it; the resolved sections are as planned."""
    cfg = plan.config
    if section:
        cfg = msgspec.structs.replace(cfg, **{section: msgspec.structs.replace(getattr(cfg, section), **change)})
    else:
        cfg = msgspec.structs.replace(cfg, **change)
    return msgspec.structs.replace(plan, config=cfg).sealed()


def test_an_edited_sampling_field_is_refused(planned) -> None:
    graph, plan = planned
    with pytest.raises(FlowRLError, match="rollout.top_p"):
        api.check(graph, edited(plan, "rollout", top_p=0.5))


@pytest.mark.parametrize(
    ("section", "change", "field"),
    [
        ("train", {"lr": 0.5}, "train.lr"),
        ("train", {"grad_clip": 0.01}, "train.grad_clip"),
        ("train", {"weight_decay": 0.1}, "train.weight_decay"),
        ("train", {"betas": (0.5, 0.5)}, "train.betas"),
        ("train", {"epochs": 3}, "train.epochs"),
        ("algo", {"kl_coef": 0.9}, "algo.kl_coef"),
        (None, {"nodes": {"advantages": {"eps": 0.1}}}, "nodes"),
    ],
    ids=["lr", "grad_clip", "weight_decay", "betas", "epochs", "kl_coef", "nodes"],
)
def test_an_edited_field_that_resolve_copied_is_refused_naming_it(planned, section, change, field) -> None:
    graph, plan = planned
    changed = edited(plan, section, **change)
    # what would run is the resolved value, not the edited one
    assert changed.models["actor"].optimizer == plan.models["actor"].optimizer
    assert changed.options == plan.options
    with pytest.raises(FlowRLError, match=field.replace(".", r"\.")):
        api.check(graph, changed)


def test_a_plan_missing_a_models_resolved_spec_is_refused(planned) -> None:
    graph, plan = planned
    models = {k: v for k, v in plan.models.items() if k != "ref"}
    with pytest.raises(FlowRLError, match="ref"):
        api.check(graph, msgspec.structs.replace(plan, models=models).sealed())


def test_a_plan_resolving_a_model_the_graph_lacks_is_refused(planned) -> None:
    graph, plan = planned
    ghost = msgspec.structs.replace(plan.models["ref"], model="ghost", training_engine="local")
    models = {**plan.models, "ghost": ghost}
    with pytest.raises(FlowRLError, match="ghost"):
        api.check(graph, msgspec.structs.replace(plan, models=models).sealed())
