"""The planner's pipeline terms (`flowrl.planner.pipeline`, `CostModel.pipeline`, `memory`): the bubble of each
schedule, the stage imbalance the embedding, LM head and loss make, and the activations each schedule keeps in
flight, checked against torch 2.13's own schedules replayed op by op."""

from __future__ import annotations

import itertools

import pytest

from flowrl.contract.layout import DeviceGroup, ModelLayout, Parallel
from flowrl.contract.model import ModelSpec
from flowrl.contract.numerics import Numerics
from flowrl.planner import memory as mem
from flowrl.planner import pipeline as pipe
from flowrl.planner.cost import CostModel
from flowrl.planner.hardware import HARDWARE_PRESETS
from flowrl.planner.modelspec import MODEL_PRESETS
from flowrl.planner.space import layouts, schedules

H100 = HARDWARE_PRESETS["H100-80G"]
LLAMA = MODEL_PRESETS["llama3-8b"]
# SmolLM2-135M's shape (HuggingFaceTB/SmolLM2-135M config.json): a 49152-token vocabulary on a 576-wide model
SMOL = ModelSpec(
    name="smollm2-135m",
    layers=30,
    hidden=576,
    heads=9,
    kv_heads=3,
    intermediate=1536,
    vocab=49152,
    tied_embeddings=True,
)


def layout(pp: int, schedule: str = "1f1b", v: int = 1, micro_batch: int = 1, dp: int = 1) -> ModelLayout:
    return ModelLayout(
        model="actor",
        group="all",
        parallel=Parallel(dp=dp, tp=1, pp=pp),
        micro_batch=micro_batch,
        schedule=schedule,
        virtual_stages=v,
    )


# ------------------------------------------------------------------ torch's schedules, replayed


def torch_order(schedule: str, pp: int, v: int, m: int) -> list[list[tuple[int, str, int]]]:
    """Each rank's (stage, "F" | "B", micro-batch) in the order torch 2.13 runs them: interleaved 1F1B's
    ``pipeline_order`` as torch builds it; GPipe's and 1F1B's as their ``_step_microbatches`` loops run them
    (all forwards then all backwards; ``min(m, pp - stage)`` warm-up forwards, then a backward before each
    further forward)."""
    if schedule == "interleaved":
        from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
        from torch.distributed.pipelining.schedules import _ComputationType

        kinds = {_ComputationType.FORWARD: "F", _ComputationType.FULL_BACKWARD: "B"}
        ops = get_schedule_ops("Interleaved1F1B", pp, m, v)
        return [[(a.stage_index, kinds[a.computation_type], a.microbatch_index) for a in r if a] for r in ops]
    out = []
    for s in range(pp):
        if schedule == "gpipe":
            out.append([(s, "F", i) for i in range(m)] + [(s, "B", i) for i in range(m)])
            continue
        warmup = min(m, pp - s)
        order, forward = [(s, "F", i) for i in range(warmup)], warmup
        for b in range(m):
            order.append((s, "B", b))
            if forward < m:
                order.append((s, "F", forward))
                forward += 1
        out.append(order)
    return out


def replay(schedule: str, pp: int, v: int, m: int, forward: list[float]) -> tuple[float, list[float]]:
    """(makespan, each rank's peak micro-batches in flight) of torch's order with stage ``s`` taking
    ``forward[s]`` per forward and twice that per backward: each op starts when its rank is free and its
    inputs are done (the previous stage's forward; the next stage's backward)."""
    order, stages = torch_order(schedule, pp, v, m), pp * v
    done: dict[tuple[int, str, int], float] = {}
    at, free, live, peak = [0] * pp, [0.0] * pp, [0.0] * pp, [0.0] * pp
    while any(at[r] < len(order[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            while at[r] < len(order[r]):
                s, kind, i = order[r][at[r]]
                deps = [(s - 1, "F", i)] if kind == "F" and s else []
                if kind == "B":
                    deps = [(s, "F", i)] + ([(s + 1, "B", i)] if s < stages - 1 else [])
                if not all(d in done for d in deps):
                    break
                start = max([free[r], *(done[d] for d in deps)])
                done[(s, kind, i)] = free[r] = start + forward[s] * (1 if kind == "F" else 2)
                live[r] += (1 if kind == "F" else -1) / v
                peak[r] = max(peak[r], live[r])
                at[r] += 1
                moved = True
        assert moved, "the replayed schedule deadlocked"
    return max(done.values()), peak


CASES = [
    (s, pp, v, m)
    for s, pp, v, m in itertools.product(("gpipe", "1f1b", "interleaved"), (2, 3, 4), (1, 2, 4), (1, 2, 3, 4, 6, 8))
    if (s == "interleaved") == (v > 1) and pipe.schedule_problem(s, pp, v, m, pp * v * 4) is None
] + [("interleaved", 4, 2, 6), ("interleaved", 3, 2, 4), ("interleaved", 4, 4, 10)]  # torch's rounds, not pp's


@pytest.mark.parametrize("schedule,pp,v,m", CASES)
def test_activations_in_flight_are_what_torch_schedules_keep(schedule, pp, v, m):
    _, peak = replay(schedule, pp, v, m, [1.0] * (pp * v))
    assert [pipe.in_flight(schedule, pp, v, m, r) for r in range(pp)] == pytest.approx(peak)


@pytest.mark.parametrize("schedule,pp,v,m", CASES)
def test_step_time_is_torch_schedules_with_equal_stages_or_a_heavier_last_one(schedule, pp, v, m):
    stages = pp * v
    for forward in ([1.0] * stages, [1.0] * (stages - 1) + [1.6]):  # the last: the LM head and the loss
        makespan, _ = replay(schedule, pp, v, m, forward)
        per_rank = [3 * sum(forward[s] for s in range(r, stages, pp)) for r in range(pp)]
        assert pipe.step_seconds(per_rank, m, v) == pytest.approx(makespan)


@pytest.mark.parametrize("schedule,pp,v,m", CASES)
def test_step_time_bounds_torch_schedules_with_a_heavier_first_stage(schedule, pp, v, m):
    stages = pp * v
    forward = [1.3] + [1.0] * (stages - 1)
    makespan, _ = replay(schedule, pp, v, m, forward)
    per_rank = [3 * sum(forward[s] for s in range(r, stages, pp)) for r in range(pp)]
    assert makespan <= pipe.step_seconds(per_rank, m, v) * (1 + 1e-9) <= 1.15 * makespan


# ------------------------------------------------------------------ the bubble


@pytest.mark.parametrize("pp,m", [(2, 1), (2, 8), (4, 4), (4, 16), (8, 32)])
def test_equal_stages_idle_the_textbook_bubble(pp, m):
    assert pipe.bubble([1.0] * pp, m) == pytest.approx((pp - 1) / (m + pp - 1))
    for v in (2, 4):
        assert pipe.bubble([1.0] * pp, m, v) == pytest.approx((pp - 1) / (v * m + pp - 1))


def test_more_micro_batches_shrink_the_bubble_and_interleaving_shrinks_it_further():
    cost = CostModel(LLAMA, H100)
    rows = 64
    few = cost.pipeline(layout(4, micro_batch=16), rows, 1024, backward=True)  # 4 micro-batches
    many = cost.pipeline(layout(4, micro_batch=2), rows, 1024, backward=True)  # 32
    inter = cost.pipeline(layout(4, "interleaved", 2, micro_batch=2), rows, 1024, backward=True)
    assert few.micro_batches == 4 and many.micro_batches == 32
    assert few.bubble > many.bubble > inter.bubble > 0
    # the textbook (pp - 1) / (v m + pp - 1) for equal stages; the LM head's heavier last stage idles less of it
    assert 0.6 * 3 / (2 * 32 + 3) < inter.bubble < 3 / (2 * 32 + 3)


def test_gpipe_and_1f1b_take_the_same_time_interleaved_pays_v_times_the_crossings():
    cost = CostModel(LLAMA, H100)
    gpipe = cost.pipeline(layout(2, "gpipe", micro_batch=2), 32, 1024, backward=True)
    one = cost.pipeline(layout(2, "1f1b", micro_batch=2), 32, 1024, backward=True)
    inter = cost.pipeline(layout(2, "interleaved", 2, micro_batch=2), 32, 1024, backward=True)
    assert gpipe.seconds == one.seconds
    # pp 2: one boundary; interleaved over 2 x 2 stages: three, each rank sends or receives over all three
    assert [pipe.crossings(2, 1, r) for r in range(2)] == [1, 1]
    assert [pipe.crossings(2, 2, r) for r in range(2)] == [3, 3]
    assert inter.p2p == pytest.approx(tuple(3 * x for x in one.p2p))


def test_the_pipeline_flushes_once_per_mini_batch():
    cost = CostModel(LLAMA, H100)
    whole = cost.pipeline(layout(4, micro_batch=1), 64, 512, backward=True, mini_batches=1)
    four = cost.pipeline(layout(4, micro_batch=1), 64, 512, backward=True, mini_batches=4)
    assert (whole.micro_batches, whole.steps) == (64, 1) and (four.micro_batches, four.steps) == (16, 4)
    assert four.bubble > whole.bubble and four.seconds > whole.seconds
    assert cost.forward(layout(4, micro_batch=1), 64, 512, backward=True, mini_batches=4) == four.seconds


# ------------------------------------------------------------------ stage imbalance


def test_the_lm_head_makes_the_last_stage_of_a_small_vocabulary_heavy_model_the_slowest():
    # SmolLM2's head (49152 x 576: 28.3M weights) is about a fifth of its matmul FLOPs, as many as 8 of its 30
    # decoder layers (3.54M weights each) at no context
    flops = [pipe.rank_flops_per_token(SMOL, 1, 0, 0)]
    head = 2 * SMOL.vocab * SMOL.hidden
    assert 0.20 < head / flops[0] < 0.22
    assert 7.5 < head / (2 * SMOL.layer_parameters()) < 8.5
    split = [pipe.rank_flops_per_token(SMOL, 2, r, 64) for r in range(2)]
    assert sum(split) == pytest.approx(SMOL.flops_per_token(64))  # the cut moves FLOPs, it makes none
    assert split[1] > 1.5 * split[0]
    cost = CostModel(SMOL, H100)
    pc = cost.pipeline(layout(2, micro_batch=4), 64, 128, backward=True)
    assert pc.per_rank[1] > 1.3 * pc.per_rank[0] and pc.imbalance > 1.1  # 15 layers + head vs 15 layers
    # the slowest stage sets the pace: the step is slower than an even share of the same work would be
    even = [sum(pc.per_rank) / 2] * 2
    assert pc.step_s > pipe.step_seconds(even, pc.micro_batches)
    assert pc.idle[0] > pc.bubble  # the first stage also waits on the last


def test_memory_per_device_is_the_largest_stages_embedding_or_head_included():
    numerics = Numerics()
    whole = mem.state_bytes(SMOL, numerics, layout(1), trainable=True)
    halves = mem.state_bytes(SMOL, numerics, layout(2), trainable=True)
    # tied: one V x H matrix for pp 1; with pp 2 the first stage holds the embedding, the last its own head
    first = SMOL.vocab * SMOL.hidden + 15 * SMOL.layer_parameters()
    last = SMOL.vocab * SMOL.hidden + SMOL.hidden + 15 * SMOL.layer_parameters()
    assert pipe.rank_parameters(SMOL, 2, 0) == first and pipe.rank_parameters(SMOL, 2, 1) == last
    assert halves > 0.6 * whole  # not half: both ends hold a vocabulary x hidden matrix
    assert halves / whole == pytest.approx(last / SMOL.parameters(), rel=1e-6)


# ------------------------------------------------------------------ activations in flight


def test_gpipe_keeps_every_micro_batch_1f1b_at_most_pp_interleaved_a_little_more():
    numerics = Numerics(recompute=False)
    acts = {
        (name, m): mem.activation_bytes(LLAMA, numerics, layout(4, s, v), 512, training=True, micro_steps=m)
        for name, s, v in (("gpipe", "gpipe", 1), ("1f1b", "1f1b", 1), ("int2", "interleaved", 2))
        for m in (4, 8, 16)
    }
    assert acts["gpipe", 4] < acts["gpipe", 8] < acts["gpipe", 16]
    assert acts["1f1b", 4] == acts["1f1b", 8] == acts["1f1b", 16]  # at most pp = 4 on the first stage
    assert acts["gpipe", 16] > 3 * acts["1f1b", 16]
    assert acts["1f1b", 8] < acts["int2", 8] < acts["gpipe", 8]
    # torch's interleaved warm-up on stage 0: (v - 1) m/rounds + 2 (pp - 1) forwards, + 1: 11 chunks of half the layers
    assert pipe.in_flight("interleaved", 4, 2, 8, 0) == 5.5


def test_a_forward_pass_keeps_no_micro_batch_in_flight():
    numerics = Numerics(recompute=False)
    for s, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        fwd = mem.activation_bytes(LLAMA, numerics, layout(4, s, v), 512, training=False, micro_steps=16)
        assert fwd == mem.activation_bytes(LLAMA, numerics, layout(4), 512, training=False)


def test_the_last_stage_of_gpipe_keeps_every_micro_batchs_logits():
    numerics = Numerics()  # recomputed layers: the logits dominate what a small model keeps
    gpipe = mem.activation_bytes(SMOL, numerics, layout(2, "gpipe"), 128, training=True, micro_steps=8)
    one = mem.activation_bytes(SMOL, numerics, layout(2, "1f1b"), 128, training=True, micro_steps=8)
    logits = 128 * SMOL.vocab * 4 * 2
    assert gpipe - one >= 6 * logits


# ------------------------------------------------------------------ the search


def test_the_search_offers_each_schedule_torch_can_run():
    assert schedules(1, 32, 8) == [("1f1b", 1)]
    assert schedules(2, 32, 8) == [
        ("gpipe", 1),
        ("1f1b", 1),
        ("interleaved", 2),
        ("interleaved", 4),
        ("interleaved", 8),
    ]
    assert schedules(4, 24, 8) == [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)]  # 24 = 4 x 2 x 3 layers
    assert schedules(4, 32, 2) == [("gpipe", 1)]  # 1F1B needs at least pp micro-batches
    assert schedules(4, 32, 6) == [("gpipe", 1), ("1f1b", 1)]  # interleaved: a multiple of pp micro-batches
    group = DeviceGroup(name="all", devices=4, first=0)
    opts = layouts("actor", group, trainable=False, per_node=8, heads=32, kv_heads=8, layers=32, batch=16)
    pp4 = {(lay.schedule, lay.virtual_stages) for lay in opts if lay.parallel.pp == 4}
    assert pp4 == {("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 4), ("interleaved", 8)}
    assert {(lay.schedule, lay.virtual_stages) for lay in opts if lay.parallel.pp == 1} == {("1f1b", 1)}


def test_schedule_problems_name_torchs_rule():
    assert "at least pp" in pipe.schedule_problem("1f1b", 4, 1, 2, 32)
    assert "divide" in pipe.schedule_problem("interleaved", 4, 4, 8, 24)
    assert "multiple of pp" in pipe.schedule_problem("interleaved", 4, 2, 10, 32)  # torch alone would take it
    assert pipe.schedule_problem("interleaved", 4, 2, 12, 32) is None
    assert pipe.schedule_problem("gpipe", 4, 2, 8, 32) is not None  # one stage per rank
    assert pipe.schedule_problem("gpipe", 4, 1, 1, 32) is None


def test_sends_and_receives_count_as_not_computing_not_as_idle():
    cost = CostModel(LLAMA, H100)
    pc = cost.pipeline(layout(2, micro_batch=2), 32, 1024, backward=True)
    assert all(x > 0 for x in pc.p2p)
    for idle, away in zip(pc.idle, pc.not_computing):
        assert away > idle  # the engine's hook counts a rank's transfers with its wait
    assert pc.not_computing[0] - pc.idle[0] == pytest.approx(pc.micro_batches * pc.p2p[0] / pc.step_s)
