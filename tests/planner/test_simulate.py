"""The discrete-event simulator: long tails, rollout policies, weight sync, timelines.

Plans are built by hand (not by the tuner) so that each test compares exactly two or three
plans that differ in one decision.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import numpy as np
import pytest

from flowrl import api
from flowrl.contract.layout import ClusterPlan
from flowrl.contract.workload import LogNormal
from flowrl.planner import memory as mem
from flowrl.planner.autotune import Tuner
from flowrl.planner.cost import CostModel
from flowrl.planner.hardware import parse_cluster
from flowrl.planner.modelspec import MODEL_PRESETS
from flowrl.planner.simulate import (
    Generator,
    SimResult,
    draw_timeline,
    simulate,
    sync_seconds,
    timeline_json,
)
from flowrl.planner.space import (
    DeviceGroup,
    GenerationLayout,
    ModelLayout,
    Parallel,
    RolloutPolicy,
    WeightSync,
    skeletons,
)
from flowrl.planner.workload import Fixed, WorkloadSpec

MODEL = MODEL_PRESETS["qwen2.5-1.5b"]
CLUSTER = parse_cluster("16xA100-80G")

SYNC = RolloutPolicy()
PARTIAL = RolloutPolicy(staleness=1, partial=True, overprovision=0.25)
ONE_STEP_OFF = RolloutPolicy(mode="one_step_off", staleness=1)
ASYNC = RolloutPolicy(mode="async", staleness=2, partial=True, overprovision=0.25)
BUCKETED = WeightSync(strategy="bucketed")


def workload(sigma: float | None, *, median: int = 512, prompts: int = 128) -> WorkloadSpec:
    """``sigma=None``: every response exactly ``median`` tokens; else a clamped lognormal."""
    length = Fixed(value=median) if sigma is None else LogNormal(median=median, sigma=sigma, max=8192)
    return WorkloadSpec(prompts_per_step=prompts, samples_per_prompt=4, prompt_length=512, response_length=length)


HEAVY = workload(1.5)


def graph(name: str = "grpo"):
    return api.load(name)[0]


def disaggregated(rollout: RolloutPolicy, sync: WeightSync = BUCKETED, *, gen: int = 8) -> ClusterPlan:
    """Generation on ``gen`` devices (tp 1), actor + reference trained on the rest."""
    train = CLUSTER.devices - gen
    models = tuple(
        ModelLayout(model=m, group="train", parallel=Parallel(dp=train, tp=1, pp=1), micro_batch=4)
        for m in ("actor", "ref")
    )
    return ClusterPlan(
        placement="disaggregated",
        groups=(DeviceGroup(name="gen", devices=gen, first=0), DeviceGroup(name="train", devices=train, first=gen)),
        models=models,
        generation=GenerationLayout(group="gen", tp=1, replicas=gen),
        rollout=rollout,
        weight_sync=sync,
    )


def colocated(rollout: RolloutPolicy = SYNC) -> ClusterPlan:
    n = CLUSTER.devices
    models = tuple(
        ModelLayout(model=m, group="all", parallel=Parallel(dp=n, tp=1, pp=1), micro_batch=4) for m in ("actor", "ref")
    )
    return ClusterPlan(
        placement="colocate",
        groups=(DeviceGroup(name="all", devices=n, first=0),),
        models=models,
        generation=GenerationLayout(group="all", tp=1, replicas=n),
        rollout=rollout,
        weight_sync=WeightSync(strategy="reshard"),
    )


def run(
    plan: ClusterPlan, w: WorkloadSpec = HEAVY, *, graph_name: str = "grpo", iterations: int = 5, seed: int = 0
) -> SimResult:
    g = graph(graph_name)
    tuner = Tuner(g, MODEL, CLUSTER, w, seed=seed)
    gen_members = [m for m in plan.models if m.group == plan.generation.group]
    static = sum(mem.state_bytes(MODEL, tuner.numerics, m, m.model in tuner.roles.trainable) for m in gen_members)
    return simulate(g, plan, tuner.cost, w, tuner.roles, static_gen_bytes=static, iterations=iterations, seed=seed)


def off_generation(result: SimResult) -> float:
    return sum(v for k, v in result.breakdown.items() if k != "rollout")


# ------------------------------------------------------------------ the hand-built plans are real points of the space


def test_hand_built_plans_are_points_of_the_enumerated_space():
    tuner = Tuner(graph(), MODEL, CLUSTER, HEAVY)
    sks = skeletons(tuner.roles, CLUSTER.devices, CLUSTER.devices_per_node, MODEL.heads, MODEL.kv_heads)
    shapes = {(s.placement, s.groups, s.generation, s.rollout, s.weight_sync) for s in sks}
    for plan in (
        disaggregated(SYNC),
        disaggregated(PARTIAL),
        disaggregated(ONE_STEP_OFF),
        disaggregated(ASYNC, WeightSync(strategy="sparse", density=0.1)),
        colocated(),
        colocated(PARTIAL),
    ):
        assert (plan.placement, plan.groups, plan.generation, plan.rollout, plan.weight_sync) in shapes, plan.summary()


# ------------------------------------------------------------------ (a) the tail costs what it costs


def test_iteration_time_grows_with_the_tail_at_a_fixed_median():
    plan = colocated()
    times = [run(plan, workload(sigma)).iteration_s for sigma in (0.0, 0.5, 1.0, 1.5)]
    assert times == sorted(times) and len(set(times)) == 4, times
    assert times[-1] > 2 * times[0], times  # sigma 1.5: the longest of 512 responses is ~25x the median
    gen = [run(plan, workload(sigma)).breakdown["rollout"] for sigma in (0.0, 1.5)]
    assert gen[1] > 3 * gen[0], gen


def test_sigma_zero_lognormal_is_the_fixed_length():
    plan = colocated()
    a, b = run(plan, workload(0.0)), run(plan, workload(None))
    assert a.iteration_s == pytest.approx(b.iteration_s, rel=1e-12)
    assert a.breakdown == pytest.approx(b.breakdown, rel=1e-12)


# ------------------------------------------------------------------ (b) partial rollouts


def test_partial_rollouts_with_overprovision_beat_sync_under_a_heavy_tail():
    sync, partial = run(disaggregated(SYNC)), run(disaggregated(PARTIAL))
    # a group is done when its longest sample is: 4 samples a prompt keep much of the tail in every group,
    # and continuous batching already fills the slots the short ones free, so partial gains little here
    assert partial.breakdown["rollout"] <= sync.breakdown["rollout"], (partial.breakdown, sync.breakdown)
    assert partial.iteration_s < 1.02 * sync.iteration_s
    single = msgspec.structs.replace(HEAVY, samples_per_prompt=1, prompts_per_step=512)
    one, part = run(disaggregated(SYNC), single), run(disaggregated(PARTIAL), single)
    assert part.breakdown["rollout"] < 0.8 * one.breakdown["rollout"]  # one sample a prompt: the tail is cut
    assert part.iteration_s < 0.9 * one.iteration_s
    # training sees other lengths (continued responses are long), but not more padding than sync's batch
    assert off_generation(partial) <= 1.25 * off_generation(sync)


def test_overprovision_buys_nothing_without_a_tail():
    """Fixed lengths: every response ends together, so the extra 25% prompts are pure cost."""
    w = workload(None)
    sync, partial = run(disaggregated(SYNC), w), run(disaggregated(PARTIAL), w)
    assert partial.breakdown["rollout"] >= sync.breakdown["rollout"]
    assert partial.iteration_s >= sync.iteration_s


def test_partial_rollouts_neither_drop_nor_duplicate_tokens():
    """Carry-over: unfinished responses resume next step, so over many iterations the tokens
    generated per step approach sequences x mean length, as in sync mode (nothing dropped, nothing
    generated twice)."""
    w = HEAVY
    expected = w.sequences * w.mean_response()
    partial = run(disaggregated(PARTIAL), w, iterations=20).gen_steps
    sync = run(disaggregated(SYNC), w, iterations=20).gen_steps
    assert partial == pytest.approx(expected, rel=0.05), partial / expected
    assert sync == pytest.approx(expected, rel=0.05), sync / expected


# ------------------------------------------------------------ (c) one step off-policy overlaps generation with training


def test_one_step_off_overlaps_generation_with_training():
    sync, off = run(disaggregated(SYNC)), run(disaggregated(ONE_STEP_OFF))
    # sync on separate groups: generation and training alternate, nothing overlaps
    assert sync.iteration_s >= 0.99 * (
        sync.breakdown["rollout"] + sync.breakdown["train_actor"] + sync.breakdown["weight_sync"]
    )
    # one step off: the iteration is shorter than generation + everything else in series
    assert off.iteration_s < 0.95 * (off.breakdown["rollout"] + off_generation(off))
    assert off.iteration_s < sync.iteration_s
    assert off.utilization["gen"] > sync.utilization["gen"] + 0.1, (off.utilization, sync.utilization)
    assert off.utilization["train"] > sync.utilization["train"]


def busy_per_iteration(res: SimResult, group: str) -> float:
    """Mean seconds of work one iteration puts on ``group`` (from the spans' task -> groups)."""
    tasks = {s.task for s in res.spans if group in s.groups}
    return sum(res.breakdown[t] for t in tasks)


GEN_BOUND = workload(None, median=2048)  # fixed lengths: every iteration's work is identical


@pytest.mark.parametrize("policy", [SYNC, PARTIAL], ids=["sync", "partial"])
@pytest.mark.parametrize("iterations", [3, 5])
def test_no_group_finishes_an_iteration_faster_than_its_own_work(policy, iterations):
    """A device group runs one task at a time, so in steady state an iteration takes at least
    the work it puts on each group. (With fixed lengths every iteration's work is identical.)"""
    res = run(disaggregated(policy, gen=2), GEN_BOUND, iterations=iterations)
    for g in ("gen", "train"):
        assert res.iteration_s >= busy_per_iteration(res, g) * (1 - 1e-9), (g, res.iteration_s, res.breakdown)


# Regression (fixed in 3c8c340): simulate() used to launch generation `staleness` steps ahead but never
# past iteration `iterations-1` and measured from the end of iteration 0, so the window held fewer rollouts
# than iterations. With 2 generation devices and fixed 2048-token responses, one_step_off was predicted at
# 19.5 s/iteration (5 iterations, the tuner's FINAL) although each iteration needs 22.8 s of rollout on the
# gen group; async at the tuner's QUICK 3 iterations: 9.3 s against 27.2 s (gen utilization 0.8%).
@pytest.mark.parametrize(
    "policy, iterations",
    [(ONE_STEP_OFF, 5), (ASYNC, 5), (ONE_STEP_OFF, 3), (ASYNC, 3)],
    ids=["one_step_off-final", "async-final", "one_step_off-quick", "async-quick"],
)
def test_overlapped_rollouts_are_not_faster_than_their_generation_work(policy, iterations):
    res = run(disaggregated(policy, gen=2), GEN_BOUND, iterations=iterations)
    assert res.iteration_s >= busy_per_iteration(res, "gen") * (1 - 1e-9), (res.iteration_s, res.breakdown["rollout"])


def test_generation_waits_for_the_weights_it_is_allowed_to_use():
    """Rollout k needs the weights of step k-1-lead (lead: the staleness bound, one less when partial
    continues responses): its span starts after that weight sync."""
    for policy in (SYNC, ONE_STEP_OFF, ASYNC):
        res = run(disaggregated(policy), iterations=6)
        sync_end = {s.iteration: s.end for s in res.spans if s.task == "weight_sync"}
        rollouts = [s for s in res.spans if s.task == "rollout"]
        assert len(rollouts) == 6 + policy.lead and len(sync_end) == 6  # rollouts run ahead by the policy's lead
        for s in rollouts:
            need = s.iteration - 1 - policy.lead
            if need >= 0:
                assert s.start >= sync_end[need] - 1e-9, (policy, s)
        if policy.lead:  # and it does not wait for more than that
            assert any(s.start < sync_end[s.iteration - 1] for s in rollouts if s.iteration >= 1), policy


def test_colocated_generation_cannot_overlap_training():
    sync, off = run(colocated(SYNC)), run(colocated(PARTIAL))
    for res in (sync, off):
        assert res.iteration_s >= 0.999 * sum(v for k, v in res.breakdown.items() if k not in ("reward", "advantages"))
        assert res.utilization["all"] > 0.98


# ------------------------------------------------------------------ (d) weight sync strategies


def test_weight_sync_strategies_order_sparse_bucketed_full():
    tuner = Tuner(graph(), MODEL, CLUSTER, HEAVY)
    seconds = {}
    for ws in (
        WeightSync(strategy="full"),
        WeightSync(strategy="bucketed"),
        WeightSync(strategy="sparse", density=0.1),
    ):
        seconds[ws.strategy] = sync_seconds(disaggregated(SYNC, ws), tuner.cost, tuner.roles)
    assert 0 < seconds["sparse"] < seconds["bucketed"] < seconds["full"], seconds
    # and the simulated iteration follows (sync mode: the weight sync is on the critical path)
    times = {
        s: run(disaggregated(SYNC, ws)).iteration_s
        for s, ws in (
            ("full", WeightSync(strategy="full")),
            ("bucketed", WeightSync(strategy="bucketed")),
            ("sparse", WeightSync(strategy="sparse", density=0.1)),
        )
    }
    assert times["sparse"] < times["bucketed"] < times["full"], times


def test_sparse_sync_cost_grows_with_density_and_full_with_replicas():
    tuner = Tuner(graph(), MODEL, CLUSTER, HEAVY)
    sparse = [
        sync_seconds(disaggregated(SYNC, WeightSync(strategy="sparse", density=d)), tuner.cost, tuner.roles)
        for d in (0.01, 0.1, 0.5, 1.0)
    ]
    assert sparse == sorted(sparse) and len(set(sparse)) == 4
    full = [
        sync_seconds(disaggregated(SYNC, WeightSync(strategy="full"), gen=g), tuner.cost, tuner.roles)
        for g in (2, 4, 8)
    ]
    assert all(x > 0 for x in full)


def test_weight_sync_scales_with_model_size():
    small = Tuner(graph(), MODEL_PRESETS["qwen2.5-0.5b"], CLUSTER, HEAVY)
    big = Tuner(graph(), MODEL_PRESETS["qwen2.5-7b"], CLUSTER, HEAVY)
    plan = disaggregated(SYNC, WeightSync(strategy="bucketed"))

    def moved(t):  # the bytes' share: the sync less the engine's per-tensor load calls
        return sync_seconds(plan, t.cost, t.roles) - t.cost.param_tensors * t.cost.hw.engine_tensor_overhead

    assert moved(big) > 5 * moved(small) > 0
    # a GPU engine's load pays per weight tensor, whatever their size
    assert sync_seconds(plan, small.cost, small.roles) > small.cost.param_tensors * 0.01


# ------------------------------------------------------------------ (e) timelines


@pytest.mark.parametrize(
    "plan, graph_name",
    [
        (colocated(SYNC), "grpo"),
        (colocated(PARTIAL), "remax"),
        (disaggregated(SYNC), "grpo"),
        (disaggregated(ONE_STEP_OFF), "rloo"),
        (disaggregated(ASYNC, WeightSync(strategy="sparse", density=0.1)), "grpo"),
    ],
    ids=["colocate-sync", "colocate-partial-remax", "disagg-sync", "disagg-one-step-off", "disagg-async"],
)
def test_timeline_spans_do_not_overlap_within_a_group(plan, graph_name):
    res = run(plan, graph_name=graph_name, iterations=4)
    spans = timeline_json(res)
    assert spans and json.loads(json.dumps(spans)) == spans  # plain JSON
    g = graph(graph_name)
    for it in range(4):  # every node (and the weight sync) exactly once per iteration
        tasks = sorted(s["task"] for s in spans if s["iteration"] == it)
        assert tasks == sorted([*g.nodes, "weight_sync"]), tasks
    for s in spans:
        assert s["end"] >= s["start"] >= 0
        assert set(s["groups"]) <= {x.name for x in plan.groups}
    for group in plan.groups:
        mine = sorted((s for s in spans if group.name in s["groups"]), key=lambda s: (s["start"], s["end"]))
        assert mine
        for a, b in zip(mine, mine[1:]):
            assert b["start"] >= a["end"] - 1e-6, (group.name, a, b)
    # dependencies: a node starts after its predecessors of the same iteration ended
    ends = {(s["iteration"], s["task"]): s["end"] for s in spans}
    dag = g.dag()
    for s in spans:
        if s["task"] in g.nodes:
            for p in dag.predecessors(s["task"]):
                assert s["start"] >= ends[(s["iteration"], p)] - 1e-6, (s, p)
    # utilization is the busy fraction of the measured window
    for name, u in res.utilization.items():
        assert 0 < u <= 1, (name, u)


def test_draw_timeline_writes_a_png(tmp_path: Path):
    plan = disaggregated(ONE_STEP_OFF)
    res = run(plan, iterations=3)
    out = tmp_path / "sub" / "timeline.png"
    out.parent.mkdir()
    draw_timeline(res, plan, out, title="one step off")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000


# ------------------------------------------------------------------ determinism


def test_simulation_is_deterministic_for_a_seed_and_the_seed_only_moves_sampled_lengths():
    plan = disaggregated(PARTIAL)
    a, b = run(plan, seed=7), run(plan, seed=7)
    assert a.iteration_s == b.iteration_s and a.breakdown == b.breakdown and timeline_json(a) == timeline_json(b)
    c = run(plan, seed=8)
    assert c.iteration_s != a.iteration_s  # lognormal lengths are sampled
    # training samples nothing, but its padding follows the sampled lengths
    assert c.breakdown["train_actor"] == pytest.approx(a.breakdown["train_actor"], rel=0.05)
    fixed = workload(None)
    assert run(plan, fixed, seed=1).iteration_s == run(plan, fixed, seed=2).iteration_s


def test_cost_model_is_the_tuners():
    tuner = Tuner(graph(), MODEL, CLUSTER, HEAVY)
    assert isinstance(tuner.cost, CostModel)
    assert tuner.capacity < CLUSTER.hardware.memory_bytes
    # memory is the one memory model's, under the tuner's numerics (the default: bf16, 8% reserve)
    assert tuner.numerics == mem.Numerics()
    assert tuner.capacity == mem.usable_bytes(CLUSTER.hardware, tuner.numerics)
    plan = msgspec.structs.replace(colocated(), predicted=None)
    assert run(plan).iteration_s > 0


def test_partial_rollouts_stop_when_the_batch_is_full_over_every_replica():
    """One buffer fills the batch from every replica's finished groups: each replica decodes to the same
    stop (the batch's order statistic of group lengths), so a replica with a long tail carries it rather
    than holding the step until its own share has finished."""
    w = msgspec.structs.replace(HEAVY, samples_per_prompt=4, prompts_per_step=256)
    plan = disaggregated(PARTIAL)
    gen = Generator(plan, CostModel(MODEL, CLUSTER.hardware), w, 0, np.random.default_rng(0))
    _, _, batch = gen.iteration(w.sequences, w.samples_per_prompt)
    # the carried rows of every replica were decoded to one stop (those started this step: nothing before)
    stops = {int(c.max()) for c in gen.carried[w.samples_per_prompt] if c.size}
    assert len(stops) == 1, stops
    # and the batch holds the step's groups (one group's rows more or less at ties)
    assert abs(batch.size - w.sequences) <= w.samples_per_prompt * plan.generation.replicas


def _after_generation(result: SimResult, task: str) -> tuple[float, float]:
    """(seconds ``task`` ran on after its iteration's generation ended, its own seconds), in a steady iteration."""
    it = 3
    span = next(s for s in result.spans if s.iteration == it and s.task == task)
    rollout = next(s for s in result.spans if s.iteration == it and s.task == "rollout")
    return span.end - rollout.end, result.breakdown[task]


def test_streamed_scoring_after_generation_is_the_work_of_the_groups_its_last_chunk_finished():
    """Streaming sends finished groups on at each decode chunk: under a long tail most groups finish chunks
    before the longest, so little scoring is left when generation ends; with every response the same length
    every group finishes in the last chunk and all of it is."""
    streaming = RolloutPolicy(streaming=True)
    tail, seconds = _after_generation(run(disaggregated(streaming)), "old_logprobs")
    assert 0 < tail < 0.5 * seconds, (tail, seconds)
    tail, seconds = _after_generation(run(disaggregated(streaming), workload(None)), "old_logprobs")
    assert tail == pytest.approx(seconds, rel=0.02), (tail, seconds)


@pytest.mark.parametrize("policy", [SYNC, RolloutPolicy(streaming=True), PARTIAL], ids=["sync", "streaming", "partial"])
def test_a_chunked_rollout_pays_the_engine_calls_setup_once_per_chunk(policy):
    """A chunked decode (streaming, partial, async) is one engine call per chunk, each with the call's setup
    (`generate_overhead`); an unchunked one is one call."""
    w = workload(None, median=512)  # every response 512 tokens: 4 chunks of 128
    plan = disaggregated(policy)

    def seconds(overhead: float) -> float:
        hw = msgspec.structs.replace(CLUSTER.hardware, generate_overhead=overhead)
        gen = Generator(plan, CostModel(MODEL, hw), w, 0, np.random.default_rng(0))
        return gen.iteration(w.sequences, w.samples_per_prompt)[0]

    calls = 1 if not policy.chunked else -(-512 // policy.chunk(w.max_response()))
    assert calls == (1 if policy is SYNC else 4)
    assert seconds(0.5) - seconds(0.0) == pytest.approx(0.5 * calls, rel=1e-6)
