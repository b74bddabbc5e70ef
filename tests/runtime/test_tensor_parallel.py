"""Tensor parallelism, planner against runtime: the planner's in-place decision agrees with the
schedule, memory and simulator, and the planner offers only tp sizes the engine splits. (How a
group deals rows to tp replicas and syncs each rank's own slices: tests/runtime/test_group_dispatch.py.)"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from flowrl import api
from flowrl.errors import FlowRLError
from flowrl.planner.constraints import parse_requirements
from flowrl.plugins.manager import registry
from flowrl.runtime.schedule import lower

REPO = Path(__file__).resolve().parents[2]
SMALL = ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=2", "progress=false", "checkpoint=false"]


@pytest.fixture
def ray_plugin(monkeypatch):
    """The Ray executor's entry point (what `flowrl plan --cluster cpu:N` plans for); no Ray is started."""
    from flowrl.plugins.manager import set_registry

    monkeypatch.setenv("FLOWRL_PLUGINS", "ray")
    set_registry(None)
    yield
    set_registry(None)


def plan_for(graph: str, devices: int, *require: str, extra: tuple[str, ...] = ()):
    """A plan of ``graph`` for this machine as ``devices`` CPU devices (the Ray executor's), with ``require``."""
    overrides = [*SMALL, "backend=ray", "device=cpu", *extra]
    g, cfg = api.load(graph, overrides=overrides)
    target = api.local_target(cfg, registry(), devices=devices)
    need = parse_requirements(require, g.models)
    return api.plan(
        graph, overrides=overrides, target=target, for_backend=True, options={"require": need}, emit=lambda s: None
    )


# ------------------------------------------------------------ planner vs runtime: in place


@pytest.mark.parametrize(
    ("devices", "require", "in_place"),
    [
        (2, ("actor.tp=2", "generation.tp=2"), True),  # dp1 tp2 trained, sampled tp2 on its own ranks
        (2, ("actor.dp=2", "generation.tp=2"), False),  # dp2 -> a tp2 replica: a reshard
        (2, ("actor.tp=2", "generation.tp=1"), False),  # tp2 -> two whole replicas
        (4, ("actor.dp=2", "actor.tp=2", "generation.tp=2"), False),  # dp2 x tp2: slices over dp
    ],
)
def test_the_planner_and_the_schedule_agree_on_sampling_in_place(ray_plugin, devices, require, in_place):
    """`schedule.lower` (what the runtime runs), the planner's memory pass and the simulator (no sync
    priced for a policy sampling in place) take the same in-place decision for tp layouts."""
    from flowrl.planner.passes import generates_in_place

    graph, plan = plan_for("grpo", devices, *require)
    layout = plan.layout
    sched = lower(graph, plan, same_engine=True)
    gen = layout.generation_of("actor")
    assert sched.placement("actor").in_place is in_place
    assert generates_in_place(plan, layout, "actor", gen.group) is in_place
    sync_s = layout.predicted.breakdown.get("weight_sync", 0.0)
    assert (sync_s == 0.0) is in_place, sync_s


# ------------------------------------------------------------ the planner's tp choices vs the engine's splits


def test_the_engine_refuses_a_tp_that_does_not_divide_the_mlp_width_naming_the_model():
    from flowrl.backends.local.parallelize.tensor import check_splits
    from flowrl.errors import BackendError

    config = SimpleNamespace(num_attention_heads=2, num_key_value_heads=1, intermediate_size=129)
    with pytest.raises(BackendError, match=r"model 'actor' cannot be split tp 2: intermediate_size 129"):
        check_splits(config, 2, "actor")


def test_the_planner_offers_no_tp_the_engine_cannot_split(ray_plugin):
    try:
        _, plan = plan_for("grpo", 2, "actor.tp=2", extra=("tiny_model.intermediate_size=129",))
    except FlowRLError:
        return  # refused at planning time: correct
    pytest.fail(f"planned an unsplittable layout: {plan.layout.layout('actor').parallel}")
