"""What one device of a placed group holds: resident model states, LoRA bases that hold no weights,
models that sample in place or with a kept replica, and a micro-batch's pass bytes. Read by
`micro_batch` (fitting micro-batches in `place`) and `memory`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from flowrl.contract.layout import ClusterPlan, ModelLayout
from flowrl.contract.model import ModelSpec
from flowrl.contract.plan import ExecutionPlan
from flowrl.errors import PlanError
from flowrl.graph.ir import Graph
from flowrl.planner import memory as mem

if TYPE_CHECKING:
    pass


def sequence_length(plan: ExecutionPlan) -> int:
    """The longest row a train or forward pass holds (`WorkloadSpec.longest_trained_row`)."""
    return plan.workload.longest_trained_row()


def placed_layout(plan: ExecutionPlan) -> ClusterPlan:
    if plan.layout is None:
        raise PlanError("the plan has no placement yet; run the 'place' pass first.")
    return plan.layout


def trainable_models(graph: Graph) -> set[str]:
    return {m for m, d in graph.models.items() if d.trainable}


def model_spec(graph: Graph, plan: ExecutionPlan, model: str) -> ModelSpec:
    """The shape graph model ``model`` computes with: the target's, with a scalar head in place of the LM head
    for a critic, reward or cost model (`ModelSpec.scalar_head`)."""
    decl = graph.models.get(model)
    return plan.target.spec(model).with_head(decl is not None and decl.scalar_head)


def trained_parameters(graph: Graph, plan: ExecutionPlan, model: str) -> int | None:
    """The parameters of ``model`` that take gradients: its LoRA adapters, or None (all of them)."""
    lora = plan.models[model].lora if model in plan.models else None
    return None if lora is None else model_spec(graph, plan, model).lora_parameters(lora.rank, lora.target_modules)


def group_states(graph: Graph, plan: ExecutionPlan, layout: ClusterPlan, group: str) -> dict[str, int]:
    """The resident model states on one device of ``group``, by model."""
    t, trainable = plan.target, trainable_models(graph)
    out = {}
    for m in layout.models:
        if m.group != group:
            continue
        base_of = lora_base(graph, plan, layout, m.model)
        if base_of is not None:  # held once, in its LoRA model's weights
            out[f"model {m.model} (the base of {base_of}'s LoRA: its weights)"] = 0
            continue
        kind = "weights+grads+optimizer" if m.model in trainable else "weights"
        out[f"model {m.model} ({kind})"] = mem.state_bytes(
            model_spec(graph, plan, m.model),
            t.numerics,
            m,
            m.model in trainable,
            trained_parameters(graph, plan, m.model),
        )
    return out


def budgeted_rows(rows: int, seq_len: int, max_tokens: int | None) -> int:
    """The rows of a micro-batch of ``rows`` under a token budget (``train.max_tokens_per_micro_batch``):
    as many rows of ``seq_len`` tokens as the budget holds, at least one (a longer row is computed alone)."""
    return rows if max_tokens is None else max(1, min(rows, max_tokens // max(seq_len, 1)))


def generates_in_place(plan: ExecutionPlan, layout: ClusterPlan, model: str | None, group: str) -> bool:
    """Whether ``model`` samples on ``group`` with the weights its training engine holds there (the
    training engine generating, colocated, on one device): no second copy of its weights."""
    run = plan.models.get(model or "")
    if not plan.target.numerics.generation_in_place or run is None or run.generation_engine != run.training_engine:
        return False
    # a model sharded over several devices samples with a replica per generation replica (as `lower` runs it),
    # unless its tp ranks are the generation layout's
    return layout.generation_of(model or "").group == group and layout.trains_as_it_generates(model or "")


def resident_replica(plan: ExecutionPlan, layout: ClusterPlan, model: str | None) -> bool:
    """Whether ``model`` generates with a replica an engine that otherwise samples in place (the torch
    engine: `Numerics.generation_in_place`) builds beside its sharded training engine and keeps."""
    run = plan.models.get(model or "")
    trained = next((m for m in layout.models if m.model == model), None)
    return (
        plan.target.numerics.generation_in_place
        and run is not None
        and trained is not None
        and run.generation_engine == run.training_engine
        and trained.group == layout.generation_of(model or "").group
    )


def lora_base(graph: Graph, plan: ExecutionPlan, layout: ClusterPlan, model: str) -> str | None:
    """The LoRA-trained model whose base ``model`` is -- a frozen LM initialised from it, from the same
    folder, both on one device of one group -- and so holds no weights of its own (the torch engine
    runs it as that model with its adapters switched off); None otherwise."""
    decl = graph.models.get(model)
    if decl is None or decl.trainable or decl.scalar_head or decl.init_from is None:
        return None
    run, source = plan.models.get(model), plan.models.get(decl.init_from)
    if run is None or source is None or source.lora is None or run.checkpoint != source.checkpoint:
        return None
    mine, theirs = layout.layout(model), layout.layout(decl.init_from)
    alone = all(lay.parallel.dp * lay.parallel.tp * lay.parallel.pp == 1 for lay in (mine, theirs))
    return decl.init_from if alone and mine.group == theirs.group else None


def pass_bytes(graph: Graph, plan: ExecutionPlan, lay: ModelLayout, size: int, seq_len: int, trainable: bool) -> int:
    """`memory.model_pass_bytes` of ``lay`` with micro-batches of ``size`` rows."""
    return mem.model_pass_bytes(
        model_spec(graph, plan, lay.model),
        plan.target.numerics,
        msgspec.structs.replace(lay, micro_batch=size),
        seq_len,
        trainable,
        trained=trained_parameters(graph, plan, lay.model),
    )


def left_gathered(graph: Graph, plan: ExecutionPlan, layout: ClusterPlan, node: str) -> dict[str, int]:
    """The models of forward or train node ``node``'s device group that may still be gathered whole from a
    forward-only pass while it runs (`memory.gathered_while`), with their bytes (`memory.left_gathered_bytes`)."""
    group = layout.layout(graph.nodes[node].model or "").group
    out = {}
    for model in mem.gathered_while(graph, node, plan.fused):
        lay = layout.layout(model)
        held = mem.left_gathered_bytes(model_spec(graph, plan, model), plan.target.numerics, lay)
        if lay.group == group and held:
            out[model] = held
    return out
