"""The ``micro_batch`` pass. Reads the plan's layout, config and options; writes each node's plan
(`NodePlan`: its group, rows per step and micro-batch size). Also `fit_micro_batches`, which
`place` uses to halve a one-device layout's micro-batches until their activations fit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from flowrl.contract.layout import ClusterPlan
from flowrl.contract.plan import ExecutionPlan, NodePlan
from flowrl.graph.ir import Forward, Generate, Graph, Train
from flowrl.planner import memory as mem
from flowrl.planner.passes.residency import group_states, pass_bytes, placed_layout, sequence_length, trainable_models
from flowrl.planner.passes.rows import node_mini_batches, plan_rows

if TYPE_CHECKING:
    from flowrl.planner.passes.context import PlanContext


def micro_batch(ctx: PlanContext, plan: ExecutionPlan) -> ExecutionPlan:
    """Set each node's rows per step and micro-batch: configured, or its model layout's."""
    cfg, layout = plan.config, placed_layout(plan)
    nodes = []
    for name, rows in plan_rows(ctx, plan).items():
        node = ctx.graph.nodes[name]
        group = None
        size = rows
        if isinstance(node, Generate):
            group = layout.generation_of(node.model).group
        elif node.model is not None:
            lay = layout.layout(node.model)
            group = lay.group
            if isinstance(node, (Forward, Train)):
                size = min(cfg.train.micro_batch_size or lay.micro_batch, rows)
                if isinstance(node, Train):  # a micro-batch never spans two mini-batches
                    size = min(size, max(rows // node_mini_batches(plan, node), 1))
        runs = None
        if isinstance(node, Generate) and node.multi_turn:  # what plays its episodes
            runs = f"agent {node.agent}" if node.agent is not None else f"env {node.env}"
        nodes.append(
            NodePlan(node=name, kind=node.kind, group=group, rows=rows, micro_batch_size=max(size, 1), runs=runs)
        )
    return msgspec.structs.replace(plan, nodes=tuple(nodes))


def fit_micro_batches(graph: Graph, plan: ExecutionPlan, layout: ClusterPlan) -> ClusterPlan:
    """Halve each model's micro-batch (unless configured) until its activations take at most half
    the headroom its device has left after the resident model states."""
    if plan.config.train.micro_batch_size is not None:
        return layout
    t, seq_len, trainable = plan.target, sequence_length(plan), trainable_models(graph)
    capacity = mem.usable_bytes(t.cluster.hardware, t.numerics)
    rooms = {
        g.name: max(capacity - sum(group_states(graph, plan, layout, g.name).values()), 0) // 2 for g in layout.groups
    }
    models = []
    for lay in layout.models:
        room = rooms[lay.group]
        size = lay.micro_batch
        while size > 1 and pass_bytes(graph, plan, lay, size, seq_len, lay.model in trainable) > room:
            size = (size + 1) // 2
        models.append(msgspec.structs.replace(lay, micro_batch=size))
    return msgspec.structs.replace(layout, models=tuple(models))
