"""The ``memory`` pass. Reads the plan's layout, node plans, runs and target numerics; writes one
`MemoryEstimate` per device group (the bytes one device needs: resident states plus the largest
transient, with the breakdown). Verification then refuses a plan that does not fit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from flowrl.contract.plan import ExecutionPlan, MemoryEstimate
from flowrl.planner import memory as mem
from flowrl.planner.passes.residency import (
    budgeted_rows,
    generates_in_place,
    group_states,
    placed_layout,
    resident_replica,
    sequence_length,
    trainable_models,
)
from flowrl.planner.passes.rows import node_mini_batches

if TYPE_CHECKING:
    from flowrl.planner.passes.context import PlanContext


def memory(ctx: PlanContext, plan: ExecutionPlan) -> ExecutionPlan:
    """The bytes one device of each group needs: resident states plus the largest transient."""
    t, layout = plan.target, placed_layout(plan)
    seq_len = sequence_length(plan)
    estimates = []
    for g in layout.groups:
        states = group_states(ctx.graph, plan, layout, g.name)
        peaks: dict[str, int] = {}
        for n in plan.nodes:
            if n.group != g.name:
                continue
            if n.kind == "generate":
                model = ctx.graph.nodes[n.node].model
                in_place = generates_in_place(plan, layout, model, g.name)
                resident = not in_place and resident_replica(plan, layout, model)
                gen = layout.generation_of(model or "")
                if resident:  # the torch engine's own replica, built once and kept: a state of the group
                    states[f"model {model} (its generation replica's weights)"] = int(
                        t.spec(model).parameters() * t.numerics.weight_bytes / gen.tp
                    )
                what = "its compute copy" if in_place or resident else "generation weights"
                peaks[f"node {n.node} ({what} + KV cache)"] = mem.generation_bytes(
                    t.spec(model), t.numerics, gen, n.rows, seq_len, in_place or resident
                )
                trained = next((m for m in layout.models if m.model == model), None)
                if resident and trained is not None and mem.sharded(t.numerics, trained, True):
                    # the sync gathers the sharded weights whole on every rank before they load
                    peaks[f"weight sync of {model} (its gathered weights)"] = int(
                        t.spec(model).parameters() * t.numerics.weight_bytes
                    )
            elif n.kind in ("forward", "train"):
                node = ctx.graph.nodes[n.node]
                model = node.model
                lay = layout.layout(model)
                training = n.kind == "train"
                budget = plan.models[model].max_tokens_per_micro_batch
                size = budgeted_rows(n.micro_batch_size, seq_len, budget)
                name = f"node {n.node} activations" + (" (+ its compute copy)" if t.numerics.compute_copy_bytes else "")
                steps = mem.micro_steps(
                    n.rows, lay, size, node_mini_batches(plan, node) if training else 1, budget is None
                )
                peaks[name] = mem.pass_bytes(
                    t.spec(lay.model), t.numerics, msgspec.structs.replace(lay, micro_batch=size), seq_len,
                    training=training, trainable=model in trainable_models(ctx.graph), micro_steps=steps,
                )  # fmt: skip
        need, breakdown = mem.group_need(states, peaks)
        estimates.append(
            MemoryEstimate(
                group=g.name,
                capacity_bytes=mem.usable_bytes(t.cluster.hardware, t.numerics),
                required_bytes=need,
                breakdown=breakdown,
            )
        )
    return msgspec.structs.replace(plan, memory=tuple(estimates))
