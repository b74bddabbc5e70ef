"""The Python entry points the CLI uses: plan a graph, run a plan."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable

from flowrl.graph.ir import Graph
from flowrl.graph.loading import build_graph, find_graph
from flowrl.planner.manager import initial_plan, run_passes
from flowrl.planner.passes import DEFAULT_PIPELINE, verify_plan
from flowrl.planner.plan import ExecutionPlan
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


def plan(source: str, *, registry: Registry | None = None, passes: Iterable[str] = DEFAULT_PIPELINE, print_after: Iterable[str] = (), emit: Callable[[str], None] = print, **kwargs: Any) -> tuple[Graph, ExecutionPlan]:
    reg = registry or default_registry()
    graph, cfg = load(source, registry=reg, **kwargs)
    return graph, run_passes(graph, initial_plan(graph, source, cfg), reg, passes=passes, print_after=print_after, emit=emit)


def graph_for_plan(p: ExecutionPlan, registry: Registry | None = None) -> Graph:
    """Rebuild the graph a plan names, with the plan's config, and re-check the plan on it."""
    reg = registry or default_registry()
    graph = build_graph(find_graph(p.graph.source, reg), p.config)
    verify_plan(graph, p)
    return graph


def run(graph: Graph, p: ExecutionPlan, *, registry: Registry | None = None, out_dir: Path | None = None, on_step: Callable[[dict[str, Any]], None] | None = None) -> Any:
    from flowrl.runtime.executor import Executor, run_dir

    executor = Executor(graph, p, registry or default_registry())
    out = out_dir or run_dir(p.config.out, p.config.name or graph.name)
    return executor.run(out, on_step=on_step)
