"""The one memory model: bytes a model, its activations and generation need on one device.

Every plan, from this laptop's one device to a 512-GPU cluster, is checked with these
functions; how a backend holds a model (dtypes, activation recomputation, eager attention,
how many sequences a generation replica decodes at once) comes in as `Numerics`, which the
backend declares.

    states       = P/(tp*pp) * weight_bytes  (+ grad_bytes + optimizer_bytes/dp when trainable)
                   (pp > 1: the largest stage's parameters, not P/pp: `pipeline.rank_parameters`)
    activations  = tokens of one micro-batch * (kept across layers + one layer's working set) + logits
                   (pp > 1: kept for every micro-batch in flight on a stage: `pipeline.in_flight`;
                   a scalar head's model, `ModelSpec.scalar_head`: one value per token, no logits)
    gathered     = sharded over dp (`sharded`): the weights it gathers while it computes, and in a train
                   step their unsharded gradients (LoRA: the adapters' alone)
    generation   = weights/tp + KV cache of the sequences one replica decodes at once
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

from flowrl.contract.hardware import HardwareSpec
from flowrl.contract.layout import GenerationLayout, ModelLayout
from flowrl.contract.model import ModelSpec
from flowrl.contract.numerics import Numerics
from flowrl.planner import pipeline as pipe

if TYPE_CHECKING:
    from flowrl.graph.ir import Graph

GiB = 1024**3
REPLICATED_HIDDEN = 5  # of a layer's working set (16 x hidden, below), the hidden-sized tensors tp does not split


def usable_bytes(hw: HardwareSpec, numerics: Numerics | None = None) -> int:
    return int(hw.memory_bytes * (1 - (numerics or Numerics()).reserve))


def state_bytes(
    model: ModelSpec, numerics: Numerics, layout: ModelLayout, trainable: bool, trained: int | None = None
) -> int:
    """One device's weights, and for a trainable model its gradients and optimizer states, of the
    ``trained`` parameters (LoRA adapters) or all (None). Split into pipeline stages, the largest stage's:
    the first (embedding) or the last (final norm and LM head)."""
    p = layout.parallel
    zero3 = p.dp if sharded(numerics, layout, trainable) else 1
    shard = pipe.largest_rank_parameters(model, p.pp) / (p.tp * zero3)  # pp > 1: the first or last stage's
    total = shard * numerics.weight_bytes
    if trainable:
        grads = shard if trained is None else trained / (p.tp * p.pp * zero3)
        total += grads * (numerics.grad_bytes + (0 if trained is None else 4))  # adapters: float32 copies too
        if not layout.offload_optimizer:  # sharded over dp either way
            total += grads * zero3 / p.dp * numerics.optimizer_bytes
    return int(total)


def sharded(numerics: Numerics, layout: ModelLayout, trainable: bool) -> bool:
    """Whether a model's weights and gradients are sharded over its data-parallel devices
    (`Numerics.sharded_states`)."""
    return numerics.sharded_states and trainable and layout.parallel.dp > 1


def micro_steps(rows: int, layout: ModelLayout, size: int, mini_batches: int = 1, even: bool = True) -> int:
    """The micro-batches of ``size`` rows the busiest rank of ``layout`` computes for a mini-batch of
    ``rows`` rows in ``mini_batches`` (split as `torch.chunk` splits them: the first the largest),
    shared over its data-parallel ranks -- evenly, or (``even`` False: dealt by tokens under a token
    budget) at worst all on one rank."""
    mini = -(-rows // max(mini_batches, 1))
    mine = -(-mini // layout.parallel.dp) if even else mini
    return max(-(-mine // max(size, 1)), 1)


def activation_bytes(
    model: ModelSpec, numerics: Numerics, layout: ModelLayout, seq_len: int, *, training: bool, micro_steps: int = 1
) -> int:
    """Peak activations of one micro-batch: what is kept across layers for backward (the layer
    inputs with recomputation, every layer's working set without), one layer's working set,
    and fp32 logits (and their gradient when training). Split into pipeline stages (pp > 1), the
    largest stage's: a train step keeps what its layers keep for every micro-batch in flight there
    (``micro_steps``: micro-batches per step, `pipeline.in_flight`), the last stage also the logits
    of those its schedule keeps (`pipeline.logits_in_flight`)."""
    if layout.parallel.pp == 1:
        working, kept, logits = _per_token(model, numerics, layout, seq_len, training)
        return int(layout.micro_batch * seq_len * ((kept if training else 0.0) + working + logits))
    return max(
        held + transient
        for held, transient in stage_activations(
            model, numerics, layout, seq_len, training=training, micro_steps=micro_steps
        )
    )


def stage_activations(
    model: ModelSpec, numerics: Numerics, layout: ModelLayout, seq_len: int, *, training: bool, micro_steps: int = 1
) -> list[tuple[int, int]]:
    """Each pipeline stage's (pp > 1; one per rank) activations at its peak, as (held, transient): ``held``
    what it keeps for the backward of its micro-batches in flight (`pipeline.in_flight`; its layers' kept
    tensors, and on the last stage the logits of those its schedule keeps), ``transient`` one layer's working
    set of the micro-batch it computes (and on the last stage its logits, forward only)."""
    p = layout.parallel
    tokens = layout.micro_batch * seq_len
    working, kept, logits = _per_token(model, numerics, layout, seq_len, training)
    out = []
    for rank in range(p.pp):
        last = rank == p.pp - 1
        if training:
            flight = pipe.in_flight(layout.schedule, p.pp, layout.virtual_stages, micro_steps, rank)
            held = flight * kept + (pipe.logits_in_flight(layout.schedule, micro_steps) * logits if last else 0)
            out.append((int(tokens * held), int(tokens * working)))
        else:
            out.append((0, int(tokens * (working + (logits if last else 0)))))
    return out


def _per_token(
    model: ModelSpec, numerics: Numerics, layout: ModelLayout, seq_len: int, training: bool
) -> tuple[float, float, float]:
    """Bytes per token of a micro-batch on one rank: (one layer's working set, what the rank's ``layers //
    pp`` decoder layers keep for the backward (their inputs with recomputation, every working set without),
    the fp32 logits over its vocabulary slice -- one value with a scalar head -- with their gradient when
    ``training``)."""
    p = layout.parallel
    b = numerics.activation_bytes
    scores = model.heads * seq_len if numerics.eager_attention else 0
    # tensor parallel splits the heads' and the MLP's tensors; the layer's input, its norms and the
    # residual stream stay whole on every rank without sequence parallelism (Korthikanti et al. 2022:
    # 10sbh of a layer's 34sbh bytes are not split)
    whole = REPLICATED_HIDDEN * model.hidden if p.tp > 1 else 0
    working = (whole + ((16 * model.hidden - whole) + 2 * model.intermediate + scores) / p.tp) * b
    kept = (model.hidden * b if numerics.recompute else working) * (model.layers // p.pp)
    logits = model.outputs * 4 * (2 if training else 1) / (1 if model.scalar_head else p.tp)
    return working, kept, logits


def compute_copy_bytes(model: ModelSpec, numerics: Numerics, layout: ModelLayout) -> int:
    """The copy of one device's weights a model computes with, while it computes (`Numerics.compute_copy_bytes`)."""
    p = layout.parallel
    return int(pipe.largest_rank_parameters(model, p.pp) / p.tp * numerics.compute_copy_bytes)


def gathered_bytes(
    model: ModelSpec,
    numerics: Numerics,
    layout: ModelLayout,
    *,
    training: bool,
    micro_steps: int = 1,
    trained: int | None = None,
) -> int:
    """What a sharded model (`sharded`) holds unsharded while it computes: its decoder layers' parameters
    -- all of them with `Numerics.gather_whole`, else two (the one computing and the next, prefetched)
    -- and the root's (embeddings, head, final norm), in the precision it computes in; in a train
    step a layer's unsharded gradient, or, gathering whole over ``micro_steps`` > 1 micro-batches of a
    mini-batch, the whole model's, accumulated until the last reduces it. ``trained``: the parameters
    that take gradients (LoRA adapters; None: all): FSDP2 gathers the whole model but holds and
    accumulates the gradients of those alone (all of them here: a layer's adapters are a few bytes)."""
    p = layout.parallel
    layers = model.layers // p.pp
    layer = model.layer_parameters() / p.tp
    if p.pp == 1:
        root = (model.parameters() - model.layers * model.layer_parameters()) / p.tp
    else:  # the largest stage's root: the embedding, or the final norm and head
        root = (pipe.largest_rank_parameters(model, p.pp) - layers * model.layer_parameters()) / p.tp
    held = ((layers if numerics.gather_whole else 2) * layer + root) * (
        numerics.compute_copy_bytes or numerics.weight_bytes
    )
    if not training:
        return int(held)
    if trained is not None:  # the adapters' gradients: at most all of them, accumulated or not
        return int(held + min(trained / (p.tp * p.pp), layers * layer + root) * numerics.grad_bytes)
    accumulated = numerics.gather_whole and micro_steps > 1
    return int(held + (layers * layer + root if accumulated else layer) * numerics.grad_bytes)


def pass_bytes(
    model: ModelSpec,
    numerics: Numerics,
    layout: ModelLayout,
    seq_len: int,
    *,
    training: bool,
    trainable: bool = False,
    micro_steps: int = 1,
    trained: int | None = None,
) -> int:
    """One micro-batch's peak beyond the model's states: its activations, and its compute copy -- kept
    for the backward unless each layer is recomputed from its input -- or, sharded, what it gathers
    (``micro_steps``: a train step's micro-batches per mini-batch on one rank; ``trained``: the parameters
    that take gradients, LoRA adapters, or None: all). `pass_parts` splits it."""
    acts, other = pass_parts(
        model, numerics, layout, seq_len, training=training, trainable=trainable, micro_steps=micro_steps,
        trained=trained,
    )  # fmt: skip
    return acts + other


def pass_parts(
    model: ModelSpec,
    numerics: Numerics,
    layout: ModelLayout,
    seq_len: int,
    *,
    training: bool,
    trainable: bool = False,
    micro_steps: int = 1,
    trained: int | None = None,
) -> tuple[int, int]:
    """`pass_bytes` as (activations, the rest): the compute copy, or for a sharded model the weights it
    gathers (and in a train step their unsharded gradients: `gathered_bytes`)."""
    acts = activation_bytes(model, numerics, layout, seq_len, training=training, micro_steps=micro_steps)
    if sharded(numerics, layout, trainable):
        return acts, gathered_bytes(
            model, numerics, layout, training=training, micro_steps=micro_steps, trained=trained
        )
    return acts, (0 if training and numerics.recompute else compute_copy_bytes(model, numerics, layout))


def model_pass_bytes(
    model: ModelSpec,
    numerics: Numerics,
    layout: ModelLayout,
    seq_len: int,
    trainable: bool,
    micro_steps: int = 1,
    trained: int | None = None,
) -> int:
    """The largest `pass_bytes` of a model's passes: a trained model's train step or its forward passes."""
    forward = pass_bytes(model, numerics, layout, seq_len, training=False, trainable=trainable)
    if not trainable:
        return forward
    train = pass_bytes(
        model, numerics, layout, seq_len, training=True, trainable=True, micro_steps=micro_steps, trained=trained
    )
    return max(forward, train)


def left_gathered_bytes(model: ModelSpec, numerics: Numerics, layout: ModelLayout) -> int:
    """What a sharded model gathering whole (`Numerics.gather_whole`: FSDP2's reshard_after_forward=False)
    still holds after a forward-only pass returns, until its next backward: every parameter, in the
    precision it computes in. 0 for a model that is not sharded or gathers layer by layer."""
    if not (numerics.gather_whole and sharded(numerics, layout, True)):
        return 0
    return gathered_bytes(model, numerics, layout, training=False)


def gathered_while(graph: Graph, node: str, fused: Collection[str] = ()) -> list[str]:
    """The trained models other than graph node ``node``'s that may still be gathered from a forward-only pass
    while it runs (`left_gathered_bytes`, where they are sharded on its devices): a model stays gathered from
    a forward until its next backward, so one with a forward node that may run before ``node`` (``node`` is
    no ancestor of it) with none of its train nodes surely in between (an ancestor of ``node``: each forward
    of a trained model precedes its train nodes). A forward its train step computes (``fused``) runs no pass."""
    import networkx as nx

    dag = graph.dag()
    before, after = nx.ancestors(dag, node), nx.descendants(dag, node)
    mine = graph.nodes[node].model
    out = []
    for model, decl in graph.models.items():
        if model == mine or not decl.trainable or any(t in before for t in graph.train_nodes(model)):
            continue
        forwards = [
            n.name for n in graph.nodes.values() if n.kind == "forward" and n.model == model and n.name not in fused
        ]
        if any(f != node and f not in after for f in forwards):
            out.append(model)
    return out


def generation_bytes(
    model: ModelSpec, numerics: Numerics, gen: GenerationLayout, sequences: int, max_len: int, in_place: bool = False
) -> int:
    """Weights of one generation replica plus the KV cache it needs: a static batch holds every
    sequence at full length (all of a replica's, or at most ``decode_batch`` with `Numerics.static_decode`);
    a paged, continuously batched engine needs room for one sequence of ``max_len`` tokens and runs as many at
    once as the rest of memory holds. ``in_place``: the
    training engine samples with the weights it trains (held with its states), so the replica
    needs only the copy it computes with."""
    per_replica = max(1, -(-sequences // gen.replicas))
    live = 1
    if numerics.static:
        live = min(per_replica, numerics.decode_batch or per_replica)
    held = numerics.compute_copy_bytes if in_place else numerics.weight_bytes
    weights = model.parameters() * held // gen.tp
    return weights + live * max_len * model.kv_bytes_per_token(numerics.activation_bytes) // gen.tp


def kv_capacity(
    model: ModelSpec, numerics: Numerics, hw: HardwareSpec, tp: int, static_bytes: int, context: int
) -> int:
    """How many sequences of ``context`` tokens fit in the KV cache of one generation replica
    of ``tp`` devices, after ``static_bytes`` of resident model states and its weights."""
    free = usable_bytes(hw, numerics) - static_bytes - model.parameters() * numerics.weight_bytes / tp
    per_seq = context * model.kv_bytes_per_token(numerics.activation_bytes) / tp
    return max(int(free // per_seq), 0)


def group_need(states: Mapping[str, int], peaks: Mapping[str, int]) -> tuple[int, dict[str, int]]:
    """Bytes one device of a group needs: every resident model state plus the largest transient
    peak (one model's activations, or generation), with the breakdown that explains it."""
    breakdown = dict(states)
    if peaks:
        name, value = max(peaks.items(), key=lambda kv: kv[1])
        breakdown[f"peak: {name}"] = value
    return sum(breakdown.values()), breakdown
