"""Pipeline parallelism's cost terms: how a model cut into ``pp`` stages (``v`` = ``virtual_stages`` per rank)
shares its layers, parameters and FLOPs among the ranks, and what each schedule costs in time (the bubble)
and in memory (activations in flight), as torch.distributed.pipelining (torch 2.13) runs GPipe, 1F1B and
interleaved 1F1B (`ScheduleGPipe`, `Schedule1F1B`, `ScheduleInterleaved1F1B`).

The cut is even: each of the ``pp * v`` stages holds ``layers / (pp * v)`` decoder layers; rank ``r`` holds
stages ``r, r + pp, ...``. The first stage also holds the embedding (a lookup: no FLOPs, but its weights and
optimizer states), the last the final norm, the LM head (a vocabulary x hidden matmul) and the loss (a
log-softmax over the vocabulary). With ``u_r`` rank r's seconds per micro-batch and ``m`` micro-batches:

    step       T = m * max_r u_r + (sum_r u_r - max_r u_r) / v
               (equal ranks: m u + (pp - 1) u / v, a bubble of (pp - 1) / (v m + pp - 1) of the step;
               the slowest rank sets the pace, the others idle the difference)
    p2p        one crossing per stage boundary and micro-batch each way: pp - 1 boundaries, pp v - 1 interleaved
    in flight  the micro-batches whose activations a rank keeps for their backward, at most:
               GPipe m; 1F1B min(m, pp - r) (rank r's warm-up forwards); interleaved min(w_r + 1, v m) stage
               chunks of 1 / v of the rank's layers, w_r = min((v - 1) m_round + 2 (pp - 1 - r), v m) its
               warm-up forwards and m_round = m / max(1, m // pp) micro-batches per round (torch's
               `_get_warmup_ops`; its steady state runs each forward before the backward that frees one)

The step formula is exact for equal stages and GPipe/1F1B, and a close bound otherwise (tests/planner
replays torch's own schedules to check both).
"""

from __future__ import annotations

from typing import get_args

from flowrl.contract.layout import ModelLayout, PipelineSchedule
from flowrl.contract.model import ModelSpec

SCHEDULES: tuple[str, ...] = get_args(PipelineSchedule)
#: the virtual stages per rank the search tries for interleaved 1F1B (where the layers divide)
VIRTUAL_STAGES = (2, 4, 8)


def schedule_problem(schedule: str, pp: int, virtual_stages: int, micro_batches: int, layers: int) -> str | None:
    """Why a model of ``layers`` decoder layers cannot run ``schedule`` over ``pp`` ranks with ``virtual_stages``
    stages each and ``micro_batches`` micro-batches per step, or None when it can: torch 2.13's rules (1F1B: at
    least pp micro-batches), and interleaved 1F1B's micro-batches a multiple of pp (Megatron's rule, which the
    torch engine keeps: it pads a step to it), its pp x v stages dividing the layers."""
    if schedule not in SCHEDULES:
        return f"schedule '{schedule}' is none of {', '.join(SCHEDULES)}"
    if pp == 1:
        return None if virtual_stages == 1 else "virtual_stages above 1 needs pp > 1 and the interleaved schedule"
    if schedule != "interleaved":
        if virtual_stages != 1:
            return f"schedule '{schedule}' runs one stage per rank (virtual_stages 1, not {virtual_stages})"
        if layers % pp:
            return f"pp {pp} does not divide the {layers} layers"
        if schedule == "1f1b" and micro_batches < pp:
            return f"1F1B needs at least pp = {pp} micro-batches per step, not {micro_batches}"
        return None
    if virtual_stages < 2:
        return "the interleaved schedule needs virtual_stages >= 2"
    if layers % (pp * virtual_stages):
        return f"pp {pp} x virtual_stages {virtual_stages} does not divide the {layers} layers"
    if micro_batches % pp:  # torch 2.13 takes any multiple of its rounds; the torch engine pads to a multiple of pp
        return f"interleaved 1F1B needs a multiple of pp = {pp} micro-batches per step, not {micro_batches}"
    return None


def stage_layers(model: ModelSpec, pp: int, virtual_stages: int = 1) -> int:
    """Decoder layers of each stage of the even cut."""
    return model.layers // (pp * virtual_stages)


def rank_layers(model: ModelSpec, pp: int) -> int:
    """Decoder layers on each rank (its ``virtual_stages`` stages together)."""
    return model.layers // pp


def rank_parameters(model: ModelSpec, pp: int, rank: int) -> int:
    """Parameters rank ``rank`` of ``pp`` holds: its decoder layers, and the embedding on the first, the final
    norm and head on the last (the LM head its own copy when tied: the ends are different ranks)."""
    if pp == 1:
        return model.parameters()
    held = rank_layers(model, pp) * model.layer_parameters()
    if rank == 0:
        held += model.vocab * model.hidden
    if rank == pp - 1:
        held += model.head_parameters() + model.hidden
    return held


def largest_rank_parameters(model: ModelSpec, pp: int) -> int:
    """The most parameters one rank holds: the first's or the last's (embedding, or head and final norm)."""
    return max(rank_parameters(model, pp, r) for r in (0, pp - 1))


def rank_flops_per_token(model: ModelSpec, pp: int, rank: int, context: int) -> float:
    """Forward FLOPs per token on rank ``rank``: its layers' (`ModelSpec.flops_per_token`'s terms), and on the
    last the final norm and head; the embedding is a lookup. The ranks' sum is the model's."""
    if pp == 1:
        return model.flops_per_token(context)
    per_layer = 2 * model.layer_parameters() + 4 * context * model.heads * model.dim_per_head
    flops = rank_layers(model, pp) * per_layer
    if rank == pp - 1:
        flops += 2 * (model.head_parameters() + model.hidden)
    return float(flops)


def crossings(pp: int, virtual_stages: int, rank: int) -> int:
    """Stage boundaries rank ``rank`` sends or receives over per micro-batch and direction: a receive into each
    of its stages but the first of the model, a send out of each but the last."""
    stages = pp * virtual_stages
    mine = range(rank, stages, pp)
    return sum(s > 0 for s in mine) + sum(s < stages - 1 for s in mine)


def step_seconds(per_rank: list[float], micro_batches: int, virtual_stages: int = 1) -> float:
    """Seconds of one pipelined step of ``micro_batches`` micro-batches, ``per_rank[r]`` the seconds rank r
    computes (and sends) per micro-batch: ``m * max + (sum - max) / v``."""
    slowest = max(per_rank)
    return micro_batches * slowest + (sum(per_rank) - slowest) / virtual_stages


def bubble(per_rank: list[float], micro_batches: int, virtual_stages: int = 1) -> float:
    """The fraction of a step the slowest rank idles (the pipeline's fill and drain); a faster rank idles
    more (`idle`)."""
    return 1 - micro_batches * max(per_rank) / step_seconds(per_rank, micro_batches, virtual_stages)


def idle(per_rank: list[float], micro_batches: int, virtual_stages: int = 1) -> list[float]:
    """Each rank's idle fraction of a step: the bubble, and the time it waits on a slower rank."""
    total = step_seconds(per_rank, micro_batches, virtual_stages)
    return [1 - micro_batches * u / total for u in per_rank]


def warmup_forwards(pp: int, virtual_stages: int, micro_batches: int, rank: int) -> int:
    """Forwards of stage chunks rank ``rank`` runs before its first backward in interleaved 1F1B (torch's
    `_get_warmup_ops`, with its rounds of ``m // max(1, m // pp)`` micro-batches)."""
    per_round = micro_batches // max(1, micro_batches // pp)
    warmup = (virtual_stages - 1) * per_round + 2 * (pp - 1 - rank)
    return min(warmup, micro_batches * virtual_stages)


def in_flight(schedule: str, pp: int, virtual_stages: int, micro_batches: int, rank: int) -> float:
    """The most micro-batches whose activations rank ``rank`` keeps at once for their backward, in units of one
    micro-batch through all the rank's layers (an interleaved stage chunk is 1 / v of one)."""
    m = micro_batches
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(m, pp - rank))
    chunks = min(warmup_forwards(pp, virtual_stages, m, rank) + 1, m * virtual_stages)
    return chunks / virtual_stages


def logits_in_flight(schedule: str, micro_batches: int) -> int:
    """Micro-batches whose logits (and log-probs) the last stage keeps for their backward: all of them in GPipe;
    one in 1F1B and interleaved 1F1B (the last stage runs each backward right after its forward)."""
    return micro_batches if schedule == "gpipe" else 1


def layout_problem(layout: ModelLayout, model: ModelSpec, micro_batches: int) -> str | None:
    """`schedule_problem` of a layout whose train step takes ``micro_batches`` micro-batches per rank."""
    return schedule_problem(layout.schedule, layout.parallel.pp, layout.virtual_stages, micro_batches, model.layers)
