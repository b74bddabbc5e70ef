"""Engines declare what they can compute at registration, composed with the executor's.

- A generation engine that declares model parallelism (vLLM does, for tp replicas) gives a run
  generation tp > 1 beside another training engine (`for_run` keeps each engine's declaration).
- An engine registered with ``capabilities=`` something other than an `EngineCapabilities` (the
  executor's `Capabilities`, a dict) is refused at registration, as executors' capabilities are.
- Requiring pipeline stages of an engine that declares none names the engine, not divisibility."""

from __future__ import annotations

from typing import Any

import pytest

from flowrl.contract.capabilities import Capabilities, EngineCapabilities, compose, for_run
from flowrl.errors import PluginError
from flowrl.plugins.hookspecs import hookimpl
from flowrl.plugins.manager import load_plugins


def _factory(ctx: Any) -> Any:
    raise NotImplementedError("a declaration-only engine")


class SplittingSampler:
    """A generation engine that splits its model over ranks (as vLLM's tp replicas do)."""

    @hookimpl
    def register_generation_engines(self, register: Any) -> None:
        register("splitter", _factory, capabilities=EngineCapabilities(model_parallel=True))


def test_a_splitting_generation_engine_beside_the_local_trainer_may_run_generation_tp() -> None:
    reg = load_plugins(entry_points=False, extra=[("splitter", SplittingSampler())])[1]
    executor = Capabilities()  # places anything (as the Ray executor does)
    declared = reg.entry("generation_engines", "splitter").meta["capabilities"]
    expected = compose(executor, EngineCapabilities(), declared)
    assert expected.generation_parallel  # what compose says: the generation engine splits its model
    run = for_run(executor, reg, ["local"], ["splitter"])
    assert run.generation_parallel
    assert run.model_parallel and run.pipeline_parallel  # the local trainer splits tensor-parallel and by layers


class MisdeclaredEngines:
    """A plugin author passes the executor's Capabilities (or a dict) instead of EngineCapabilities."""

    def __init__(self, capabilities: Any) -> None:
        self.capabilities = capabilities

    @hookimpl
    def register_training_engines(self, register: Any) -> None:
        register("tp_typo", _factory, capabilities=self.capabilities)


@pytest.mark.parametrize(
    "capabilities",
    [Capabilities(model_parallel=True), {"model_parallel": True}],
    ids=["executor-Capabilities", "dict"],
)
def test_an_engine_registered_with_something_else_than_engine_capabilities_is_refused(capabilities) -> None:
    with pytest.raises(PluginError, match="capabilities"):
        load_plugins(entry_points=False, extra=[("tp-typo", MisdeclaredEngines(capabilities))])


class PlainTrainer:
    """A training engine that declares nothing: one unsplit model per rank."""

    @hookimpl
    def register_training_engines(self, register: Any) -> None:
        register("plain", _factory)


class AnyLayoutExecutor:
    """An executor plugin that places any layout on any number of devices (as the Ray executor does)."""

    @hookimpl
    def register_executors(self, register: Any) -> None:
        from flowrl.backends.local.executor import LocalExecutor, machine

        class Placer(LocalExecutor):
            capabilities = Capabilities()

        register("placer", Placer, machine=machine)


def test_requiring_pp_of_an_engine_that_splits_no_layers_names_the_engine_not_divisibility() -> None:
    """`--require actor.pp=2` with a training engine that declares no pipeline parallelism on an
    executor that could place it: the message must say that the engine cannot split a model, not that
    "pp must divide the model's layers" (2 divides the tiny model's 2 layers)."""
    from flowrl import api
    from flowrl.errors import PlanError
    from flowrl.planner.constraints import parse_requirements

    reg = load_plugins(entry_points=False, extra=[("placer", AnyLayoutExecutor()), ("plain", PlainTrainer())])[1]
    overrides = ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "executor=placer"]
    overrides += ["train.engine=plain", "generation.engine=local"]
    graph, cfg = api.load("grpo", registry=reg, overrides=overrides)
    assert cfg.tiny_model.num_layers % 2 == 0
    target = api.local_target(cfg, reg, devices=2)
    require = parse_requirements(["actor.pp=2", "placement=colocate"], graph.models)
    with pytest.raises(PlanError) as refused:
        api.plan(
            "grpo",
            registry=reg,
            overrides=overrides,
            target=target,
            for_backend=True,
            options={"require": require},
            emit=lambda s: None,
        )
    message = str(refused.value)
    assert "no pipeline parallelism" in message and "pipeline_parallel=True" in message, message
