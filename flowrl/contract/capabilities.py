"""What a run can do, declared by who does it: an executor declares what it can place and schedule
(`Capabilities`), each engine what it can compute (`EngineCapabilities`, given when it is
registered). `compose` gives what a run with that executor and those engines can run; the tuner
searches only that, and the executor refuses any other plan before it builds a model."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import msgspec

from flowrl.contract.layout import (
    ClusterPlan,
    ModelLayout,
    Placement,
    RolloutMode,
    RolloutPolicy,
    SyncStrategy,
    WeightSync,
)
from flowrl.contract.numerics import Numerics
from flowrl.graph.ir import Generate, Graph
from flowrl.specs import AUTO, RunConfig, Spec


class Registry(Protocol):
    """What capabilities read of the plugin registry (`flowrl.plugins.manager.Registry`): the names
    registered of a kind, and an entry with the ``meta`` it was registered with."""

    def names(self, kind: str) -> Any: ...

    def entry(self, kind: str, name: str) -> Any: ...


class Capabilities(Spec):
    max_devices: int | None = None  # None: any cluster
    placements: tuple[Placement, ...] = ("colocate", "split", "standalone", "disaggregated")
    rollout_modes: tuple[RolloutMode, ...] = ("sync", "one_step_off", "async")
    partial_rollouts: bool = True
    streaming: bool = True  # scoring nodes on finished groups while generation goes on
    weight_sync: tuple[SyncStrategy, ...] = ("reshard", "full", "bucketed", "sparse")
    model_parallel: bool = True  # a trained model's layout with tp > 1 (tensor parallel)
    pipeline_parallel: bool = True  # a trained model's layout with pp > 1
    generation_parallel: bool = True  # generation replicas with tp > 1
    optimizer_offload: bool = True
    numerics: Numerics = Numerics()


class EngineCapabilities(Spec):
    """What an engine can compute, declared when it is registered
    (``register(name, factory, capabilities=EngineCapabilities(...))``); an engine that declares
    nothing runs one unsplit model per rank, without offload."""

    model_parallel: bool = False  # its model split over ranks tensor-parallel (tp > 1; generation: its replicas)
    pipeline_parallel: bool = False  # its model split over ranks by layers (pp > 1)
    optimizer_offload: bool = False  # optimizer states in host memory between steps
    # a train step computes the ports `TrainStep.own` names itself (the model's outputs, detached):
    # the planner may then fuse an old-log-prob forward into it (`flowrl.contract.reading.fusable`)
    own_outputs: bool = False
    # generation on accelerators replays each decode step as a captured graph (CUDA graphs) with the
    # collectives in its own kernels: no host work per module call around them (the planner's tp costs)
    captured_decode: bool = False


def compose(
    executor: Capabilities, training: EngineCapabilities, generation: EngineCapabilities | None = None
) -> Capabilities:
    """What a run can do with this executor and these engines (``generation`` None: the training
    engine generates): the executor places and schedules, the engines compute."""
    generation = generation or training
    return msgspec.structs.replace(
        executor,
        model_parallel=executor.model_parallel and training.model_parallel,
        pipeline_parallel=executor.pipeline_parallel and training.pipeline_parallel,
        generation_parallel=executor.generation_parallel and generation.model_parallel,
        optimizer_offload=executor.optimizer_offload and training.optimizer_offload,
    )


def for_run(
    executor: Capabilities, registry: Registry, training: Iterable[str], generation: Iterable[str] = ()
) -> Capabilities:
    """``executor``'s capabilities composed with those the named engines declared when they were
    registered: a run can do what every one of its engines can. A generation engine that is
    ``auto`` (chosen later) or the training engine itself counts as the training engine."""
    training = list(dict.fromkeys(training))
    train = _all([declared(registry, "training_engines", n) for n in training])
    others = [n for n in dict.fromkeys(generation) if n != AUTO and n not in training]
    gen = _all([declared(registry, "generation_engines", n) for n in others]) if others else None
    return compose(executor, train, gen)


def of_config(executor: Capabilities, registry: Registry, cfg: RunConfig) -> Capabilities:
    """`for_run` with the engines a run config names (what the planner may search)."""
    return for_run(executor, registry, [cfg.train.engine], [cfg.generation.engine])


def _all(declared: list[EngineCapabilities]) -> EngineCapabilities:
    return EngineCapabilities(
        model_parallel=all(d.model_parallel for d in declared),
        pipeline_parallel=all(d.pipeline_parallel for d in declared),
        optimizer_offload=all(d.optimizer_offload for d in declared),
        own_outputs=all(d.own_outputs for d in declared),
    )


def declared(registry: Registry, kind: str, name: str) -> EngineCapabilities:
    """What engine ``name`` declared (nothing for a name not registered: the `resolve` pass names it)."""
    if name not in registry.names(kind):
        return EngineCapabilities()
    caps = registry.entry(kind, name).meta.get("capabilities")
    return caps if isinstance(caps, EngineCapabilities) else EngineCapabilities()


def supports(
    caps: Capabilities, placement: Placement, rollout: RolloutPolicy, sync: WeightSync, generation_tp: int
) -> bool:
    """Whether ``caps`` runs a plan skeleton with these choices."""
    return (
        placement in caps.placements
        and rollout.mode in caps.rollout_modes
        and (caps.partial_rollouts or not rollout.partial)
        and (caps.streaming or not rollout.streaming)
        and sync.strategy in caps.weight_sync
        and (caps.generation_parallel or generation_tp == 1)
    )


def supports_layout(caps: Capabilities, layout: ModelLayout) -> bool:
    """Whether ``caps`` runs one model's layout."""
    p = layout.parallel
    return (
        (caps.model_parallel or p.tp == 1)
        and (caps.pipeline_parallel or p.pp == 1)
        and (caps.optimizer_offload or not layout.offload_optimizer)
    )


def unsupported(caps: Capabilities, layout: ClusterPlan, devices: int) -> list[str]:
    """The features of ``layout`` (on a cluster of ``devices``) that ``caps`` cannot run, in words."""
    out = []
    if caps.max_devices is not None and devices > caps.max_devices:
        out.append(f"a cluster of {devices} devices (at most {caps.max_devices})")
    if layout.placement not in caps.placements:
        out.append(f"placement '{layout.placement}' (runs: {', '.join(caps.placements)})")
    if layout.rollout.mode not in caps.rollout_modes:
        out.append(f"rollout mode '{layout.rollout.mode}' (runs: {', '.join(caps.rollout_modes)})")
    if layout.rollout.partial and not caps.partial_rollouts:
        out.append("partial rollouts")
    if layout.rollout.streaming and not caps.streaming:
        out.append("streaming rollouts")
    if layout.weight_sync.strategy not in caps.weight_sync:
        out.append(f"weight sync '{layout.weight_sync.strategy}' (runs: {', '.join(caps.weight_sync)})")
    for m in layout.models:
        if not caps.model_parallel and m.parallel.tp > 1:
            out.append(
                f"model '{m.model}' split tp {m.parallel.tp} (no tensor parallelism: the training engine does not "
                "declare it, or the executor cannot place it)"
            )
        if not caps.pipeline_parallel and m.parallel.pp > 1:
            out.append(
                f"model '{m.model}' split pp {m.parallel.pp} (no pipeline parallelism: the training engine does not "
                "declare EngineCapabilities(pipeline_parallel=True), or the executor cannot place it)"
            )
        if not caps.optimizer_offload and m.offload_optimizer:
            out.append(f"model '{m.model}' with its optimizer offloaded (no offload)")
    for gen in (layout.generation, *layout.generations):
        if not caps.generation_parallel and gen.tp > 1:
            out.append(f"generation tp {gen.tp} (the generation engine splits no model)")
            break
    return out


def rollout_conflict(graph: Graph, rollout: RolloutPolicy) -> str | None:
    """Why ``graph`` cannot run ``rollout`` (chunked rollouts, partial, async and streaming, serve
    one generate node), in words; None when it can."""
    generates = [n.name for n in graph.nodes.values() if isinstance(n, Generate)]
    if rollout.chunked and len(generates) > 1:
        return (
            f"rollout '{rollout.describe()}' decodes in chunks for one generate node; graph '{graph.name}' has "
            f"{len(generates)} ({', '.join(generates)}). Use rollout.mode=sync or one_step_off."
        )
    if rollout.chunked:
        filters = graph.filters()
        if filters:
            gen, name = next(iter(filters.items()))
            return (
                f"rollout '{rollout.describe()}' decodes in chunks; filter '{name}' samples rounds of generate node "
                f"'{gen}' until enough groups pass. Use rollout.mode=sync or one_step_off."
            )
    return None
