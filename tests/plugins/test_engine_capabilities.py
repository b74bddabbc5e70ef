"""Engines declare what they can compute; an executor's capabilities are what it can place and
schedule, composed with its engines'. A plugin engine that declares tensor parallelism is accepted
by the Ray executor's check without any executor change; the local engine runs tensor parallel and
pipeline stages too; an engine declaring no pipeline parallelism has a layout split by layers (pp)
refused, naming the feature, and so does the one-process executor."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from flowrl import api
from flowrl.contract.capabilities import Capabilities, EngineCapabilities, compose, of_config
from flowrl.errors import PlanError
from flowrl.planner.constraints import parse_requirements
from flowrl.plugins.hookspecs import hookimpl
from flowrl.plugins.manager import load_plugins

pytest.importorskip("flowrl_ray")

SMALL = ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "progress=false", "checkpoint=false"]


class TensorParallelPlugin:
    """A training engine that says it splits its model over ranks (it is never built here)."""

    @hookimpl
    def register_training_engines(self, register: Any) -> None:
        def factory(ctx: Any) -> Any:
            raise NotImplementedError("a declaration-only engine")

        register("tp", factory, capabilities=EngineCapabilities(model_parallel=True))


@pytest.fixture
def reg():
    return load_plugins(allow={"ray"}, extra=[("tp-engine", TensorParallelPlugin())])[1]


def tp2_plan(reg, engine: str):
    """A cpu:2 plan for the Ray executor with the actor split tp 2 (the tiny model has 2 heads)."""
    overrides = [*SMALL, "backend=ray", "device=cpu", f"train.engine={engine}", "generation.engine=local"]
    graph, cfg = api.load("grpo", registry=reg, overrides=overrides)
    target = api.local_target(cfg, reg, devices=2)
    require = parse_requirements(["actor.tp=2", "placement=colocate"], graph.models)
    return api.plan(
        "grpo",
        registry=reg,
        overrides=overrides,
        target=target,
        for_backend=True,
        options={"require": require},
        emit=lambda s: None,
    )


def test_a_tensor_parallel_engine_plugin_is_accepted_by_the_ray_executor(reg) -> None:
    graph, plan = tp2_plan(reg, "tp")
    assert plan.layout.layout("actor").parallel.tp == 2
    assert plan.target.capabilities.model_parallel  # the Ray executor places it, the engine splits it
    executor = api.executor(plan, reg)
    assert type(executor).__name__ == "RayExecutor"
    executor.check(graph, plan)  # accepted: no executor code knows about engine 'tp'


def _pp2(plan):
    """``plan`` hand-edited: the actor in 2 pipeline stages instead of 2 tensor slices."""
    actor = plan.layout.layout("actor")
    split = msgspec.structs.replace(actor, parallel=msgspec.structs.replace(actor.parallel, tp=1, pp=2))
    models = tuple(split if m.model == "actor" else m for m in plan.layout.models)
    return msgspec.structs.replace(plan, layout=msgspec.structs.replace(plan.layout, models=models))


def test_a_pipeline_parallel_layout_is_refused_naming_the_feature(reg) -> None:
    """Engine 'tp' splits a model tensor-parallel, not by layers: a hand-edited pp 2 layout is refused
    before any model is built."""
    graph, plan = tp2_plan(reg, "tp")
    edited = _pp2(plan)
    with pytest.raises(PlanError, match="no pipeline parallelism"):
        api.executor(edited, reg).check(graph, edited)


def test_the_local_engine_is_planned_tensor_parallel_and_placed_in_pipeline_stages(reg) -> None:
    graph, plan = tp2_plan(reg, "local")
    assert plan.layout.layout("actor").parallel.tp == 2
    assert plan.target.capabilities.model_parallel and plan.target.capabilities.pipeline_parallel
    api.executor(plan, reg).check(graph, plan)
    edited = _pp2(plan)
    api.executor(edited, reg).check(graph, edited)  # the Ray executor places it, the engine cuts its stages


def test_the_one_process_executor_refuses_pipeline_stages_by_name() -> None:
    from flowrl.backends.local.executor import LocalExecutor
    from flowrl.contract.capabilities import unsupported

    graph, plan = tp2_plan(load_plugins(allow={"ray"})[1], "local")
    said = unsupported(LocalExecutor.capabilities, _pp2(plan).layout, 1)
    assert any("model 'actor' split pp 2 (no pipeline parallelism" in s for s in said), said


def test_compose_takes_the_executors_placement_and_the_engines_computation() -> None:
    executor = Capabilities(model_parallel=True, generation_parallel=True, optimizer_offload=True)
    none, both = EngineCapabilities(), EngineCapabilities(model_parallel=True, optimizer_offload=True)
    assert not compose(executor, none).model_parallel and not compose(executor, none).optimizer_offload
    assert compose(executor, both).model_parallel and compose(executor, both).optimizer_offload
    mixed = compose(executor, none, both)  # a local trainer, a generation engine that splits its model
    assert not mixed.model_parallel and mixed.generation_parallel
    one_device = Capabilities(model_parallel=False, generation_parallel=False)
    assert not compose(one_device, both).model_parallel  # an executor that cannot place a split model


def test_for_run_reads_what_the_configured_engines_declared(reg) -> None:
    _, cfg = api.load("grpo", registry=reg, overrides=[*SMALL, "train.engine=tp", "generation.engine=local"])
    caps = of_config(Capabilities(), reg, cfg)
    assert caps.model_parallel and not caps.generation_parallel
