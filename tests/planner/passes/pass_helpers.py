"""What the pass tests share: small plans of the built-in graphs and the memory they should take."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from flowrl import api
from flowrl.contract.plan import ExecutionPlan
from flowrl.graph import Graph
from flowrl.planner import memory as mem
from flowrl.planner.manager import initial_plan
from flowrl.plugins.manager import Registry
from flowrl.specs import RunConfig

SMALL = ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=3"]


QUIET: Callable[[str], None] = lambda _: None  # noqa: E731


def plan(source: str, registry: Registry, *overrides: str, **kwargs: Any) -> tuple[Graph, ExecutionPlan, list[str]]:
    out: list[str] = []
    graph, p = api.plan(source, registry=registry, overrides=[*SMALL, *overrides], emit=out.append, **kwargs)
    return graph, p, out


def local_plan(graph: Graph, cfg: RunConfig, registry: Registry, source: str = "grpo") -> ExecutionPlan:
    """The initial plan for this machine, as api.plan makes it."""
    return initial_plan(graph, source, cfg, api.local_target(cfg, registry))


def trainable(graph: Graph) -> set[str]:
    return {m for m, d in graph.models.items() if d.trainable}


def states_of(graph: Graph, p: ExecutionPlan, group: str = "all") -> int:
    """The resident states of ``group``: each model the base shape, with a scalar head where its role has one."""
    t = p.target
    models = [m for m in p.layout.models if m.group == group]
    return sum(
        mem.state_bytes(
            t.model.with_head(graph.models[m.model].scalar_head), t.numerics, m, m.model in trainable(graph)
        )
        for m in models
    )


def activations(p: ExecutionPlan, model: str, rows: int, *, training: bool, graph: Graph | None = None) -> int:
    """``model``'s activations for micro-batches of ``rows`` rows (with ``graph``: a scalar head where its role
    has one)."""
    t = p.target
    lay = msgspec.structs.replace(p.layout.layout(model), micro_batch=rows)
    spec = t.model.with_head(graph is not None and graph.models[model].scalar_head)
    return mem.activation_bytes(spec, t.numerics, lay, p.workload.max_sequence(), training=training)
