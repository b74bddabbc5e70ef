"""The rows (sequences) each node sees per step, propagated along the graph's keys, and a train
node's mini-batches: read by `place` (the tuner), `micro_batch` and `memory`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flowrl.contract.plan import ExecutionPlan
from flowrl.graph.ir import Compute, Filter, Generate, Graph, Source, Train

if TYPE_CHECKING:
    from flowrl.planner.passes.context import PlanContext


def plan_rows(ctx: PlanContext, plan: ExecutionPlan) -> dict[str, int]:
    """The rows each node of ``plan`` sees per step: the workload's prompts and samples, each
    generate node's own samples where the graph did not take them from the config, the groups a
    filter passes, and one row per prompt after a compute function that reduces to prompts."""
    reduced = {}
    for node in ctx.graph.nodes.values():
        if isinstance(node, Compute) and node.fn in ctx.registry.names("compute_functions"):
            port = ctx.registry.entry("compute_functions", node.fn).meta.get("rows")
            if port is not None:
                reduced[node.name] = node.ports.get(port, port)
    w = plan.workload
    return node_rows(
        ctx.graph, w.prompts_per_step, w.samples_per_prompt, plan.config.rollout.samples_per_prompt, reduced
    )


def node_rows(
    graph: Graph,
    prompts: int,
    samples: int | None = None,
    built: int | None = None,
    reduced: dict[str, str] | None = None,
) -> dict[str, int]:
    """Sequences each node sees per step, propagated along keys from the graph inputs; a
    sampling generate node multiplies by its ``n`` (or by ``samples``, a workload's, where its
    ``n`` is the ``built`` one: the config's samples_per_prompt the graph was built with); a source
    by its rows per prompt (two for preference pairs); a
    filter with ``groups`` passes that many groups to the nodes after it; a ``reduced`` node
    writes as many rows as the key it is mapped to."""
    key_rows = {key: prompts for key in graph.inputs}
    out: dict[str, int] = {}
    for name in graph.order():
        node = graph.nodes[name]
        rows = max((key_rows.get(k, prompts) for k in node.reads), default=prompts)
        if reduced and name in reduced:  # its outputs have the rows of one key it reads (e.g. one per prompt)
            rows = key_rows.get(reduced[name], rows)
        if isinstance(node, Generate):
            n = samples if samples and (built is None or node.n == built) else node.n
            rows = rows * (1 if node.greedy else n)
        elif isinstance(node, Source):  # rows read from the data: one per prompt, or two (a preference pair)
            rows = rows * node.per_prompt
        out[name] = rows
        for key in node.writes:
            key_rows[key] = rows
        if isinstance(node, Filter) and node.groups is not None:  # the nodes after it see its groups
            gen, between = graph.filter_segment(name)
            asked = key_rows.get(graph.nodes[gen].reads[0], prompts)
            for inner in (gen, *between):
                for key in graph.nodes[inner].writes:
                    key_rows[key] = max(key_rows[key] * node.groups // max(asked, 1), 1)
            key_rows[graph.nodes[gen].reads[0]] = node.groups
    return out


def node_mini_batches(plan: ExecutionPlan, node: Train) -> int:
    """A train node's mini-batches per step, as resolved (the graph's, the config's)."""
    resolved = plan.options.get(node.name)
    if resolved is not None:
        return int(resolved.options["mini_batches"])
    return int(node.options.get("mini_batches", plan.config.train.mini_batches))
