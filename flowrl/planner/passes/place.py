"""The ``place`` pass. Reads the resolved plan (target, workload, config, runs) and the context's
options (budget_s, seed, cost_model, placement and sync pins, require, compare); writes the
plan's layout (device groups, parallel sizes, rollout policy, weight sync), the chosen generation
engine in the config and runs, and its by-products as ``ctx.results.place`` (`PlaceResult`: the
tuner's ranking, each candidate engine's predicted step, the unconstrained ranking).
One device: the colocated layout; a cluster: the auto-tuner's best.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import msgspec

from flowrl.contract.capabilities import rollout_conflict, supports
from flowrl.contract.layout import (
    ClusterPlan,
    DeviceGroup,
    GenerationLayout,
    ModelLayout,
    Parallel,
    RolloutPolicy,
    WeightSync,
)
from flowrl.contract.plan import ExecutionPlan
from flowrl.contract.reading import generating_models
from flowrl.contract.workload import WorkloadSpec
from flowrl.errors import PlanError
from flowrl.graph.ir import Generate, Graph
from flowrl.planner.constraints import Constraints
from flowrl.planner.passes.context import PlaceResult
from flowrl.planner.passes.micro_batch import fit_micro_batches
from flowrl.planner.passes.tuning import plan_tuner
from flowrl.specs import AUTO, RolloutConfig, rollout_parts

if TYPE_CHECKING:
    from flowrl.planner.autotune import Candidate, TuneResult
    from flowrl.planner.passes.context import PlanContext


def colocated(graph: Graph, workload: WorkloadSpec, micro_batch: int | None = None) -> ClusterPlan:
    """The one layout of a one-device cluster: every model on it, generation in place."""
    mini_batch = max(workload.sequences // workload.mini_batches, 1)
    mini_batch = min(micro_batch or mini_batch, mini_batch)
    return ClusterPlan(
        placement="colocate",
        groups=(DeviceGroup(name="all", devices=1, first=0),),
        models=tuple(
            ModelLayout(model=m, group="all", parallel=Parallel(dp=1, tp=1, pp=1), micro_batch=mini_batch)
            for m in graph.models
        ),
        generation=GenerationLayout(group="all", tp=1, replicas=1),
        rollout=RolloutPolicy(),
        weight_sync=WeightSync(strategy="reshard"),
        generations=tuple(
            GenerationLayout(group="all", tp=1, replicas=1, model=m) for m in generating_models(graph)[1:]
        ),
    )


def rollout_policy(rollout: RolloutConfig) -> RolloutPolicy | None:
    """The policy ``rollout.mode`` asks for (None: the tuner chooses)."""
    if rollout.mode is None:
        return None
    start, flags = rollout_parts(rollout.mode)
    partial = "partial" in flags
    eta = rollout.staleness
    if eta is None:  # the mode's own: on-policy when sync, else one version, and one more when partial
        eta = (start != "sync") + partial
    if partial and eta < 1:
        raise PlanError(
            "rollout.mode has 'partial': unfinished responses continue under the next weights, so their oldest "
            "tokens are one version old; set rollout.staleness >= 1 (or leave it unset)."
        )
    return RolloutPolicy(
        mode=start,  # type: ignore[arg-type]
        staleness=eta,
        partial=partial,
        overprovision=rollout.overprovision if partial else 0.0,
        streaming="streaming" in flags,
        chunk_tokens=rollout.chunk_tokens,
    )


def generation_engines(ctx: PlanContext, plan: ExecutionPlan) -> list[str]:
    """The generation engines a plan may use: the configured one, or for ``auto`` the training
    engine's own (it samples in float32) and every registered engine that `flowrl profile`
    calibrated on this hardware and that runs the model's head size there."""
    cfg = plan.config
    if cfg.generation.engine != AUTO:
        return [cfg.generation.engine]
    hw, head = plan.target.cluster.hardware, plan.target.spec(generating_models(ctx.graph)[0]).dim_per_head
    names = [
        name
        for name in ctx.registry.names("generation_engines")
        if name != cfg.train.engine
        and name in hw.generation
        and (not hw.generation[name].head_sizes or head in hw.generation[name].head_sizes)
    ]
    if cfg.generation.dtype == "float32":
        names.insert(0, cfg.train.engine)
    if not names:
        raise PlanError(
            f"generation.dtype={cfg.generation.dtype} needs a generation engine other than the training engine "
            f"'{cfg.train.engine}', and none is calibrated on '{hw.name}' for this model; name one with "
            "--set generation.engine=NAME (e.g. vllm), or run `flowrl profile` with it installed."
        )
    return names


def place(ctx: PlanContext, plan: ExecutionPlan) -> ExecutionPlan:
    """Place models on device groups (for a backend's one device: the colocated layout; else: the
    tuner's best), and choose the generation engine when it is ``auto``: the one whose best plan
    the simulator predicts fastest (``ctx.results.place.engines``: each candidate's step time)."""
    rollout = any(isinstance(n, Generate) for n in ctx.graph.nodes.values())
    engines = generation_engines(ctx, plan) if rollout else [plan.config.train.engine]
    tried = {name: _place(ctx, plan, name, share=len(engines)) for name in engines}
    chosen, predicted = engines[0], {}
    if len(engines) > 1:
        predicted = {name: found.tune.ranked[0].result.iteration_s for name, (_, found) in tried.items()}
        chosen = min(engines, key=lambda name: _score(tried[name][1]))
    placed, found = tried[chosen]
    ctx.results.place = dataclasses.replace(found, engines=predicted)
    cfg = placed.config
    if cfg.generation.engine != chosen:
        placed = msgspec.structs.replace(placed, config=msgspec.structs.replace(cfg, generation=msgspec.structs.replace(
            cfg.generation, engine=chosen)))  # fmt: skip
    return _with_generation(_with_objective(placed, found.tune), chosen)


def with_candidate(plan: ExecutionPlan, tune: TuneResult, candidate: Candidate) -> ExecutionPlan:
    """``plan`` (as `place` wrote it) as `place` would have written it had the tuner's ``candidate`` won:
    the candidate's layout (groups, sizes, rollout policy, weight sync), the objective's record of its own
    prediction, and its generation layout's tp in the generating models' runs. The later passes
    (`micro_batch`, `memory`) still have to run on it (`api.plan_ranked` does)."""
    if not any(c is candidate for c in tune.ranked):
        raise PlanError(f"candidate '{candidate.plan.summary()}' is not in the tuner's ranking.")
    engines = [run.generation_engine for run in plan.models.values() if run.generation_engine is not None]
    placed = msgspec.structs.replace(plan, layout=candidate.plan)
    placed = _with_objective(placed, tune, candidate)
    return _with_generation(placed, engines[0]) if engines else placed


def _score(found: PlaceResult) -> float:
    """What the tuner minimised for ``found``'s winner (seconds per iteration, or to the target)."""
    if found.tune is None:
        return 0.0
    best = found.tune.ranked[0]
    return found.tune.objective.score(best.plan, best.result.iteration_s)


def _with_objective(plan: ExecutionPlan, tune: TuneResult | None, candidate: Candidate | None = None) -> ExecutionPlan:
    """``plan`` recording the objective its layout was ranked by and ``candidate``'s (default: the winner's)
    predicted time to target."""
    if tune is None or plan.layout is None:
        return plan
    chosen = candidate or tune.ranked[0]
    record = tune.objective.record(plan.layout, chosen.result.iteration_s, tune.samples)
    return msgspec.structs.replace(plan, objective=record)


def _place(ctx: PlanContext, plan: ExecutionPlan, engine: str, share: int = 1) -> tuple[ExecutionPlan, PlaceResult]:
    """`place` with generation costed as ``engine`` generates; ``share``: candidates splitting the search
    budget. Returns the placed plan and the tuner's rankings (a graph that generates nothing: its train
    stage alone is simulated).

    A plan for a backend on one device is the colocated layout with each model's micro-batch the
    mini-batch, halved until it fits; it is still simulated, so --explain shows its prediction.
    Otherwise the auto-tuner searches the cluster (within the backend's capabilities, if any)."""
    t, opts = plan.target, ctx.options
    rollout = any(isinstance(n, Generate) for n in ctx.graph.nodes.values())
    single = None
    caps = t.capabilities
    in_place = caps is not None and supports(caps, "colocate", RolloutPolicy(), WeightSync(strategy="reshard"), 1)
    if t.cluster.devices == 1 and (in_place or not rollout):
        single = fit_micro_batches(
            ctx.graph, plan, colocated(ctx.graph, plan.workload, plan.config.train.micro_batch_size)
        )
    tuner = plan_tuner(ctx, plan, engine)
    pins = {"placement": opts.placement, "weight_sync": opts.weight_sync}
    if single is not None and any(pins.values()):
        raise PlanError("--placement / --sync choose among cluster plans; this plan is for one device.")
    require = opts.require
    for key, flag, field_ in (("placement", "--placement", "placement"), ("weight_sync", "--sync", "sync")):
        wanted = getattr(require, key, None) if require else None
        if pins[key] and wanted and pins[key] != wanted:
            raise PlanError(f"{flag} {pins[key]} contradicts --require {field_}={wanted}; keep one.")
    if single is not None and require:
        raise PlanError("--require chooses among a cluster's plans; this plan is for one device (add --cluster).")
    free_policy = rollout_policy(plan.config.rollout)
    policy = free_policy
    if require and require.rollout_mode:
        policy = rollout_policy(msgspec.structs.replace(plan.config.rollout, mode=require.rollout_mode))
    if single is not None and policy is not None:
        conflict = rollout_conflict(ctx.graph, policy)
        if conflict:
            raise PlanError(conflict)
        single = msgspec.structs.replace(single, rollout=policy)
    budget = opts.budget_s / share
    chunk = plan.config.rollout.chunk_tokens
    if single is not None:
        result = tuner.single(single)
    else:
        result = tuner.search(budget_s=budget, rollout=policy, chunk_tokens=chunk, **pins)
    free = None
    if require and opts.compare:  # the unconstrained winner, for --explain to set beside it
        tuner.constraints = Constraints()
        tuner._layout_cache.clear()
        free = tuner.search(budget_s=budget, rollout=free_policy, chunk_tokens=chunk, **pins)
        if _score(PlaceResult(tune=result)) < _score(PlaceResult(tune=free)):
            free = result  # the constrained winner is in the unconstrained space: a shorter search missed it
    return msgspec.structs.replace(plan, layout=result.best), PlaceResult(tune=result, unconstrained=free)


def _with_generation(plan: ExecutionPlan, engine: str) -> ExecutionPlan:
    """``plan`` with its generating models' runs set to ``engine`` and their layout's tp."""
    if plan.layout is None:
        return plan
    runs = dict(plan.models)
    for name, run in plan.models.items():
        if run.generation_engine is not None:
            tp = plan.layout.generation_of(name).tp
            sampling = msgspec.structs.replace(run.sampling, tp=tp)
            runs[name] = msgspec.structs.replace(run, generation_engine=engine, sampling=sampling)
    return msgspec.structs.replace(plan, models=runs)
