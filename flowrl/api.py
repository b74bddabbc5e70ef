"""The Python entry points the CLI uses: plan a graph, run a plan."""

from __future__ import annotations

from pathlib import Path

import msgspec
from typing import Any, Callable, Iterable

from flowrl.graph.ir import Graph
from flowrl.graph.loading import build_graph, find_graph
from flowrl.planner.manager import initial_plan, run_passes
from flowrl.planner.passes import CLUSTER_PIPELINE, DEFAULT_PIPELINE, PlanContext, verify_plan
from flowrl.planner.plan import ClusterTarget, ExecutionPlan
from flowrl.plugins.manager import Registry, registry as default_registry
from flowrl.specs import RunConfig, build_config, nested, parse_override


def make_config(defaults: dict[str, Any], config_file: dict[str, Any] | None = None, overrides: Iterable[str] = (), flags: dict[str, Any] | None = None) -> RunConfig:
    """Defaults of the graph < config file < --set overrides < dedicated flags."""
    layers = [defaults, config_file or {}]
    layers += [nested(*parse_override(o)) for o in overrides]
    layers.append({k: v for k, v in (flags or {}).items() if v is not None})
    return build_config(*layers)


def load(source: str, *, config_file: dict[str, Any] | None = None, overrides: Iterable[str] = (), flags: dict[str, Any] | None = None, registry: Registry | None = None) -> tuple[Graph, RunConfig]:
    reg = registry or default_registry()
    src = find_graph(source, reg)
    cfg = make_config(src.defaults, config_file, overrides, flags)
    return build_graph(src, cfg), cfg


def plan(
    source: str,
    *,
    registry: Registry | None = None,
    passes: Iterable[str] | None = None,
    print_after: Iterable[str] = (),
    emit: Callable[[str], None] = print,
    target: ClusterTarget | None = None,
    options: dict[str, Any] | None = None,
    cache: dict[str, Any] | None = None,
    **kwargs: Any,
) -> tuple[Graph, ExecutionPlan]:
    """Compile a graph. With ``target`` (a cluster, model and workload) the auto-tuner plans for
    that cluster; otherwise the plan is for this machine. ``cache`` receives pass by-products
    (e.g. ``cache["tune"]``, the tuner's ranked candidates)."""
    reg = registry or default_registry()
    graph, cfg = load(source, registry=reg, **kwargs)
    initial = msgspec.structs.replace(initial_plan(graph, source, cfg), target=target)
    if passes is None:
        passes = CLUSTER_PIPELINE if target is not None else DEFAULT_PIPELINE
    ctx = PlanContext(graph=graph, registry=reg, cache=cache if cache is not None else {}, options=options or {})
    return graph, run_passes(graph, initial, reg, passes=passes, print_after=print_after, emit=emit, ctx=ctx)


def graph_for_plan(p: ExecutionPlan, registry: Registry | None = None) -> Graph:
    """Rebuild the graph a plan names, with the plan's config, and re-check the plan on it."""
    reg = registry or default_registry()
    graph = build_graph(find_graph(p.graph.source, reg), p.config)
    verify_plan(graph, p)
    return graph


def refuse_cluster_plan(p: ExecutionPlan) -> None:
    from flowrl.errors import PlanError

    raise PlanError(
        f"this plan targets {p.target.cluster.devices} x {p.target.cluster.hardware.name}; the local backend runs plans made without --cluster. "
        "A multi-device backend (flowrl-ray) is not installed yet."
    )


def run(graph: Graph, p: ExecutionPlan, *, registry: Registry | None = None, out_dir: Path | None = None, on_step: Callable[[dict[str, Any]], None] | None = None) -> Any:
    from flowrl.runtime.executor import Executor, run_dir

    if p.target is not None:
        refuse_cluster_plan(p)
    executor = Executor(graph, p, registry or default_registry())
    out = out_dir or run_dir(p.config.out, p.config.name or graph.name)
    return executor.run(out, on_step=on_step)
