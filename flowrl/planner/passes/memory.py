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
    left_gathered,
    model_spec,
    placed_layout,
    resident_replica,
    sequence_length,
    trainable_models,
    trained_parameters,
)
from flowrl.planner.passes.rows import node_mini_batches

if TYPE_CHECKING:
    from flowrl.planner.passes.context import PlanContext


def memory(ctx: PlanContext, plan: ExecutionPlan) -> ExecutionPlan:
    """The bytes one device of each group needs: resident states plus the largest transient."""
    t, layout = plan.target, placed_layout(plan)
    seq_len = sequence_length(plan)  # the rows train and forward passes hold (padded where the trainer pads)
    generated = plan.workload.max_sequence()  # generation decodes the real lengths, padded trainer or not
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
                    t.spec(model), t.numerics, gen, n.rows, generated, in_place or resident
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
                steps = mem.micro_steps(
                    n.rows, lay, size, node_mini_batches(plan, node) if training else 1, budget is None
                )
                sized = msgspec.structs.replace(lay, micro_batch=size)
                trainable = model in trainable_models(ctx.graph)
                acts, other = mem.pass_parts(
                    model_spec(ctx.graph, plan, model), t.numerics, sized, seq_len, training=training,
                    trainable=trainable, micro_steps=steps, trained=trained_parameters(ctx.graph, plan, model),
                )  # fmt: skip
                held = left_gathered(ctx.graph, plan, layout, n.node)
                name = _pass_name(n.node, acts, other, mem.sharded(t.numerics, sized, trainable), training, t.numerics)
                peaks[name + _held_name(held)] = acts + other + sum(held.values())
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


def _pass_name(node: str, acts: int, other: int, sharded: bool, training: bool, numerics: mem.Numerics) -> str:
    """What a forward or train node's peak holds, the larger part first: its activations, and its compute copy
    or -- sharded over its data-parallel ranks -- the weights it gathers (and, training, their gradients)."""
    if sharded:
        gathered = "gathered weights" + (" and gradients" if training else "")
        parts = ["activations", gathered] if acts >= other else [gathered, "activations"]
        return f"node {node} {' + '.join(parts)}"
    return f"node {node} activations" + (" (+ its compute copy)" if numerics.compute_copy_bytes else "")


def _held_name(held: dict[str, int]) -> str:
    """The models a node's peak also holds gathered, left so by their forward passes (`left_gathered`)."""
    if not held:
        return ""
    return f" + {' and '.join(sorted(held))} left gathered by {'their' if len(held) > 1 else 'its'} forward"
