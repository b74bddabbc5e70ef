"""The pass manager: runs named passes, verifies after each, can print the plan between them.

A pass is a registered plugin (``register_passes``), a function ``(ctx, plan) -> plan``: it reads the
plan and `PlanContext` (the graph, the registry, typed `PlanOptions`) and leaves its by-products as
typed fields of ``ctx.results`` (`PassResults`). The built-in ones live in `flowrl.planner.passes`,
one module each."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import msgspec

from flowrl.contract.plan import ClusterTarget, ExecutionPlan, GraphRef, encode_plan
from flowrl.errors import FlowRLError, PlanError
from flowrl.graph.ir import Graph
from flowrl.planner.passes import PIPELINE, PlanContext, verify_plan
from flowrl.specs import RunConfig

if TYPE_CHECKING:
    from flowrl.plugins.manager import Registry


def initial_plan(graph: Graph, source: str, config: RunConfig, target: ClusterTarget) -> ExecutionPlan:
    return ExecutionPlan(
        graph=GraphRef(name=graph.name, source=source, fingerprint=graph.fingerprint()), config=config, target=target
    )


def run_passes(
    graph: Graph,
    plan: ExecutionPlan,
    registry: Registry,
    *,
    passes: Iterable[str] = PIPELINE,
    print_after: Iterable[str] = (),
    emit: Callable[[str], None] = print,
    ctx: PlanContext | None = None,
) -> ExecutionPlan:
    """Run ``passes`` in order; verify after each; return the sealed plan."""
    graph.verify()
    ctx = ctx or PlanContext(graph=graph, registry=registry)
    passes = tuple(passes)
    wanted = set(print_after)
    unknown = wanted - set(passes) - {"all"}
    if unknown:
        raise PlanError(
            f"--print-after names unknown pass(es) {', '.join(sorted(unknown))}; this pipeline runs: "
            f"{', '.join(passes)}."
        )
    for name in passes:
        fn = registry.get("passes", name)
        try:
            plan = fn(ctx, plan)
        except FlowRLError as exc:
            raise type(exc)(f"pass '{name}': {exc}") from None
        except Exception as exc:  # a bug in a (plugin) pass: name it
            raise PlanError(f"pass '{name}' crashed: {type(exc).__name__}: {exc}") from exc
        if not isinstance(plan, ExecutionPlan):
            raise PlanError(f"pass '{name}' returned {type(plan).__name__}, not an ExecutionPlan.")
        plan = msgspec.structs.replace(plan, passes=(*plan.passes, name))
        try:
            verify_plan(graph, plan)
        except PlanError as exc:
            raise PlanError(f"after pass '{name}': {exc}") from None
        if name in wanted or "all" in wanted:
            emit(f"# --- plan after pass '{name}' ---\n{encode_plan(plan)}")
    return plan.sealed()
