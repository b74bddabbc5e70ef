"""The auto-tuner that costs a plan's candidate layouts (`plan_tuner`, used by `place`), and
`replay`: the simulator's prediction of a placed plan, for calibration and a run's report.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flowrl.contract.plan import ClusterTarget, ExecutionPlan
from flowrl.errors import PlanError
from flowrl.graph.ir import Graph
from flowrl.planner.passes.context import PlanContext
from flowrl.planner.passes.rows import plan_rows

if TYPE_CHECKING:
    from flowrl.plugins.manager import Registry


def plan_tuner(ctx: PlanContext, plan: ExecutionPlan, engine: str, target: ClusterTarget | None = None) -> Any:
    """The tuner that costs ``plan``'s candidates (``target``: another cluster, model or workload), with
    generation costed as ``engine`` generates."""
    from flowrl.planner.autotune import Tuner
    from flowrl.planner.simulate import MicroBatching

    t, opts = target or plan.target, ctx.options
    objective = plan_objective(ctx, plan)
    return Tuner(
        ctx.graph,
        t.model,
        t.cluster,
        t.workload or plan.workload,
        seed=opts.seed,
        cost_model=opts.cost_model,
        registry=ctx.registry,
        numerics=t.numerics,
        capabilities=t.capabilities,
        generation_engine=engine,
        training_engine=plan.config.train.engine,
        rows=plan_rows(ctx, plan),
        train_steps=_own_train_steps(ctx.graph, plan),
        fused=plan.fused,
        constraints=opts.require,
        models=t.models or None,
        micro_batch=plan.config.train.micro_batch_size,
        batching=MicroBatching(plan.config.train.max_tokens_per_micro_batch, plan.config.train.pack),
        unsplit=[m for m, run in plan.models.items() if run.lora is not None],  # the torch engine splits no adapters
        objective=objective,
    )


def plan_objective(ctx: PlanContext, plan: ExecutionPlan) -> Any:
    """What the tuner ranks ``plan``'s candidates by (``--objective``), with the iterations a sync run needs to
    the target (``--target-steps``, else the run config's steps) and the sample efficiency in use."""
    from flowrl.planner.sample_efficiency import Objective, in_use

    opts = ctx.options
    return Objective(
        kind=opts.objective,
        target_steps=opts.target_steps or max(plan.config.steps, 1),
        efficiency=opts.efficiency or in_use(),
    )


def replay(graph: Graph, plan: ExecutionPlan, registry: Registry, target: ClusterTarget | None = None) -> Any:
    """The simulator's prediction (a ``SimResult``) of ``plan``'s layout as it was placed, on ``target``
    (default: the plan's own: its hardware, model and workload)."""
    from flowrl.planner.autotune import FINAL

    if plan.layout is None:
        raise PlanError(f"plan {plan.id or '?'} has no layout to simulate (it was not placed).")
    ctx = PlanContext(graph=graph, registry=registry)
    tuner = plan_tuner(ctx, plan, plan.config.generation.engine, target)
    return tuner.evaluate(plan.layout, **FINAL).result


def _own_train_steps(graph: Graph, plan: ExecutionPlan) -> dict[str, tuple[int, int]]:
    """Train nodes whose own options (graph or ``nodes.*``) set epochs or mini-batches: their
    (epochs, mini-batches), the workload's where the node sets only one."""
    out = {}
    for name in plan.options:
        own = {**graph.nodes[name].options, **plan.config.nodes.get(name, {})}
        if graph.nodes[name].trains and ("epochs" in own or "mini_batches" in own):
            w = plan.workload
            out[name] = (int(own.get("epochs", w.ppo_epochs)), int(own.get("mini_batches", w.mini_batches)))
    return out
