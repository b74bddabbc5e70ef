"""The cluster auto-tuner: the exact optimum on enumerable spaces, the greedy path, determinism,
the time budget, executor capabilities, and random targets that plan or fail cleanly.

Brute force here builds the plan space independently of the tuner's search: every skeleton,
the product of every model's raw layouts (``space.layouts``) on its group, the memory check
with the functions of ``flowrl.planner.memory``, and the simulation settings of the tuner's
final ranking (``autotune.FINAL``). Planning speed is measured by ``benchmarks/planner.py``,
not here: no result depends on the machine's speed. The search's clock is tests/conftest.py's
``PlannerClock`` (a budget buys the same candidates everywhere); where a test needs the whole
space searched it stops the clock (``unbounded``), and the budget itself is tested with a fake
clock of its own.

CLI, plugin presets/passes/cost models and plan files: ``test_cluster_cli.py``.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import msgspec
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from flowrl import api
from flowrl.contract.capabilities import Capabilities, of_config, unsupported
from flowrl.contract.layout import ClusterPlan
from flowrl.contract.plan import ClusterTarget, ExecutionPlan
from flowrl.contract.workload import LogNormal
from flowrl.errors import PlanError
from flowrl.graph.ir import Graph
from flowrl.planner import autotune
from flowrl.planner import memory as mem
from flowrl.planner.autotune import FINAL, Tuner, TuneResult, explain, roles_of
from flowrl.planner.hardware import HARDWARE_PRESETS, ClusterSpec, parse_cluster
from flowrl.planner.modelspec import MODEL_PRESETS, ModelSpec
from flowrl.planner.passes import PIPELINE, PassResults, colocated, engine_memory, verify_plan
from flowrl.planner.space import ModelLayout, layouts, skeletons
from flowrl.planner.workload import Fixed, WorkloadSpec

GiB = 1024**3
QWEN = MODEL_PRESETS["qwen2.5-0.5b"]
# heads 2 / kv 1 / 2 layers: tp and pp in {1, 2}, so brute force over raw layouts stays cheap
TINY = ModelSpec(name="tiny", layers=2, hidden=2048, heads=2, kv_heads=1, intermediate=5632, vocab=32000)
# one head, one layer: only dp, micro-batch and offload vary
TINY1 = ModelSpec(name="tiny1", layers=1, hidden=2048, heads=1, kv_heads=1, intermediate=5632, vocab=32000)
GRAPHS = ["ppo", "ppo_rm", "grpo", "rloo", "remax", "reinforce_pp"]


def quiet(_: str) -> None:
    pass


def load(prompts: int, *, samples: int = 1) -> WorkloadSpec:
    length = LogNormal(median=128, sigma=0.8, max=1024)
    return WorkloadSpec(prompts_per_step=prompts, samples_per_prompt=samples, prompt_length=256, response_length=length)


def mini(devices: int, memory_gib: float) -> ClusterSpec:
    """One node of A100-80G-like devices with ``memory_gib`` each (memory pressure on tiny models)."""
    hw = HARDWARE_PRESETS["A100-80G"]
    hw = msgspec.structs.replace(hw, name=f"mini-{memory_gib:g}G", memory_bytes=int(memory_gib * GiB))
    return ClusterSpec(nodes=1, devices_per_node=devices, hardware=hw)


def make_tuner(graph: str, model: ModelSpec, cluster: ClusterSpec | str, workload: WorkloadSpec, **kw) -> Tuner:
    g, _ = api.load(graph)
    return Tuner(g, model, parse_cluster(cluster) if isinstance(cluster, str) else cluster, workload, **kw)


def memoized(t: Tuner) -> Tuner:
    """Simulations are deterministic for a plan and settings: the tuner and the brute force may share them."""
    t.evaluate = functools.cache(t.evaluate)
    return t


def raw_options(t: Tuner, model: str, group) -> list[tuple[ModelLayout, float, int, int]]:
    """Every layout space.layouts() offers, unpruned: (layout, 0, state bytes, activation bytes)."""
    trainable = model in t.roles.trainable
    batch = t.w.sequences // t.w.mini_batches
    out = []
    for lay in layouts(
        model, group, trainable=trainable, per_node=t.cluster.devices_per_node,
        heads=t.model.heads, kv_heads=t.model.kv_heads, layers=t.model.layers, batch=batch,
    ):  # fmt: skip
        states = mem.state_bytes(t.model, t.numerics, lay, trainable)
        steps = mem.micro_steps(t.w.sequences, lay, lay.micro_batch, t.w.mini_batches)  # a pipeline's in flight
        acts = mem.activation_bytes(t.model, t.numerics, lay, t.max_len, training=trainable, micro_steps=steps)
        out.append((lay, 0.0, states, acts))
    return out


@dataclass
class Optimum:
    raw: float  # the best final-settings iteration time over every enumerated combination that fits
    raw_plan: ClusterPlan | None
    raw_fitting: int
    pruned: float  # the same over the tuner's Pareto options only
    pruned_plan: ClusterPlan | None
    pruned_fitting: int


def brute_force(t: Tuner, *, raw: bool = True) -> Optimum:
    """Simulate every fitting plan of the whole space (``raw``: of the raw layouts, else of the
    tuner's Pareto options); the Pareto-pruned optimum comes in the same pass."""
    o = Optimum(math.inf, None, 0, math.inf, None, 0)
    capacity = mem.usable_bytes(t.cluster.hardware, t.numerics)
    for sk in skeletons(t.roles, t.cluster.devices, t.cluster.devices_per_node, t.model.heads, t.model.kv_heads):
        groups = {g.name: g for g in sk.groups}
        pareto = {m: {opt[0] for opt in t.options(m, groups[g])} for m, g in sk.assignment}
        options = raw_options if raw else Tuner.options
        for combo in itertools.product(*(options(t, m, groups[g]) for m, g in sk.assignment)):
            choice = {m: c for (m, _), c in zip(sk.assignment, combo)}
            if any(t.group_memory(sk, choice, g.name)[0] > capacity for g in sk.groups):
                continue
            plan = ClusterPlan(
                placement=sk.placement, groups=sk.groups, models=tuple(choice[m][0] for m in t.roles.models),
                generation=sk.generation, rollout=sk.rollout, weight_sync=sk.weight_sync,
            )  # fmt: skip
            cand = t.evaluate(plan, **FINAL)
            assert max(cand.memory.values()) <= capacity
            seconds = cand.result.iteration_s
            o.raw_fitting += 1
            if seconds < o.raw:
                o.raw, o.raw_plan = seconds, plan
            if all(choice[m][0] in pareto[m] for m in choice):
                o.pruned_fitting += 1
                if seconds < o.pruned:
                    o.pruned, o.pruned_plan = seconds, plan
    return o


def test_final_ranking_settings_are_the_documented_ones():
    assert FINAL == {"iterations": 5, "max_replicas": 32}


# ------------------------------------------------------------------ 1. the optimum on enumerable spaces

SPACES = {
    # id: (graph, model, cluster, workload)
    "grpo-qwen0.5b-2xA100-80G": ("grpo", QWEN, "2xA100-80G", load(16)),
    "ppo_rm-tiny-4xA100-80G": ("ppo_rm", TINY1, "4xA100-80G", load(4)),  # four models: split and standalone
    "grpo-tiny-4x2GiB-memory-bound": ("grpo", TINY, mini(4, 2.0), load(2)),  # the actor's tp x pp sets the sync
    "rloo-tiny-2x2GiB-memory-bound": ("rloo", TINY, mini(2, 2.0), load(8)),
}
UNCONSTRAINED = ["grpo-qwen0.5b-2xA100-80G", "ppo_rm-tiny-4xA100-80G"]
MEMORY_BOUND = ["grpo-tiny-4x2GiB-memory-bound", "rloo-tiny-2x2GiB-memory-bound"]
# memory-bound PPO with a reward model: few plans fit, but more than exhaustive_limit combinations exist
MEMORY_BOUND_PPO_RM = {
    "ppo_rm-tiny1-2x2GiB-8-fitting-plans": ("ppo_rm", TINY1, mini(2, 2.0), load(8)),
    "ppo_rm-tiny-2x2GiB-340-fitting-plans": ("ppo_rm", TINY, mini(2, 2.0), load(8)),
}


class Stopped:
    """A search clock that never moves: the budget never runs out, every candidate is simulated."""

    @staticmethod
    def perf_counter() -> float:
        return 0.0


def unbounded(t: Tuner, **kw) -> TuneResult:
    """``t.search(**kw)`` over the whole space (its budget never runs out), the same on every machine."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(autotune, "time", Stopped)
        return t.search(**kw)


@functools.cache
def solved(space: str) -> tuple[Tuner, TuneResult, Optimum]:
    """The tuner's search and the brute force of the same space (the PPO spaces: Pareto options only)."""
    t = memoized(make_tuner(*(SPACES.get(space) or MEMORY_BOUND_PPO_RM[space])))
    return t, unbounded(t), brute_force(t, raw=space in SPACES)


# the brute force over raw layouts of these spaces takes a minute, ten seconds and seconds on 2 cores (and the
# 340-plan PPO space's about ten); the quick lane (-m "not slow") solves the other memory-bound spaces
BIG = {
    "grpo-qwen0.5b-2xA100-80G",
    "ppo_rm-tiny-4xA100-80G",
    "grpo-tiny-4x2GiB-memory-bound",
    "ppo_rm-tiny-2x2GiB-340-fitting-plans",
}


def spaces(names: list[str]) -> list:
    return [pytest.param(n, marks=pytest.mark.slow) if n in BIG else n for n in names]


@pytest.mark.parametrize("space", spaces(list(SPACES)))
@pytest.mark.slow
def test_search_returns_the_simulators_optimum(space):
    t, result, best = solved(space)
    found = result.ranked[0].result.iteration_s
    assert best.pruned_fitting > 0 and result.considered == best.pruned_fitting  # every fitting plan was ranked
    assert found == pytest.approx(best.pruned, rel=1e-9), (result.best.summary(), best.pruned_plan.summary())
    assert result.best.predicted.iteration_s == pytest.approx(best.pruned, abs=1e-6)
    # Pareto pruning is safe: the raw layouts hold no faster plan
    assert best.raw_fitting >= best.pruned_fitting
    assert best.raw >= found * (1 - 1e-9), (result.best.summary(), best.raw_plan.summary())
    if space in MEMORY_BOUND:  # memory rules out part of the space
        total = sum(
            math.prod(len(t.options(m, {g.name: g for g in sk.groups}[grp])) for m, grp in sk.assignment)
            for sk in skeletons(t.roles, t.cluster.devices, t.cluster.devices_per_node, t.model.heads, t.model.kv_heads)
        )
        assert best.pruned_fitting < total


@pytest.mark.parametrize("space", spaces(UNCONSTRAINED))
def test_the_greedy_path_finds_the_optimum_when_memory_does_not_bind(space):
    """Above ``exhaustive_limit`` the tuner fits each skeleton greedily; where every layout fits,
    that still reaches the optimum."""
    t, _, best = solved(space)
    greedy = unbounded(t, exhaustive_limit=0)
    assert greedy.considered < best.pruned_fitting  # the greedy path: one plan per skeleton
    # within 1%: a layout's score pays the padding of one sampled batch, the simulator each iteration's
    assert greedy.ranked[0].result.iteration_s == pytest.approx(best.raw, rel=0.01), greedy.best.summary()


@pytest.mark.parametrize("space", spaces(list(MEMORY_BOUND_PPO_RM)))
def test_memory_bound_ppo_rm_spaces_are_solved_exactly(space):
    _, result, best = solved(space)
    found = result.ranked[0].result.iteration_s
    assert 0 < best.pruned_fitting <= 4000  # small enough to enumerate
    assert found == pytest.approx(best.pruned, rel=1e-9), (found, best.pruned, best.pruned_plan.summary())


@pytest.mark.parametrize("space", spaces([*MEMORY_BOUND, *MEMORY_BOUND_PPO_RM]))
def test_greedy_fit_stays_within_4_percent_of_the_optimum_on_memory_bound_spaces(space):
    """Where the greedy path is not exact (memory binds), it is at least within 4%. (Within 2% while the
    optimum of these spaces was a one-replica plan; since partial rollouts stop at the batch's order statistic
    over every replica, a colocated two-replica plan is the optimum, and the greedy memory trade reaches
    layouts of it about 3% slower.)"""
    t, _, best = solved(space)
    found = unbounded(t, exhaustive_limit=0).ranked[0].result.iteration_s
    assert best.pruned <= found <= 1.04 * best.pruned, (found, best.pruned)
    if space in SPACES:
        assert best.raw == pytest.approx(best.pruned, rel=1e-9)


@pytest.mark.slow
def test_ranking_is_sorted_and_the_winner_is_sealed_with_a_consistent_prediction():
    w = WorkloadSpec(response_length=LogNormal(median=512, sigma=1.0, max=4096))
    t = make_tuner("ppo_rm", MODEL_PRESETS["llama-7b"], "32xA100-80G", w)
    result = t.search(budget_s=5)
    finals = [c for c in result.ranked if c.plan.predicted is not None]
    assert finals and result.ranked[0] is finals[0]
    times = [c.result.iteration_s for c in finals]
    assert times == sorted(times)
    assert result.considered == len(result.ranked)
    best = result.ranked[0]
    pred = best.plan.predicted
    assert pred.iteration_s == pytest.approx(best.result.iteration_s, abs=1e-6)
    assert set(pred.breakdown) == set(t.graph.nodes) | {"weight_sync"}
    assert pred.memory_bytes == best.memory and set(pred.memory_bytes) == {g.name for g in best.plan.groups}
    assert 0 < pred.roofline_s <= pred.iteration_s
    assert pred.efficiency == pytest.approx(pred.roofline_s / pred.iteration_s, abs=1e-3)
    # re-evaluating the winner reproduces it
    again = t.evaluate(msgspec.structs.replace(best.plan, predicted=None), **FINAL)
    assert again.result.iteration_s == best.result.iteration_s and again.memory == best.memory
    text = explain(result, t.model, t.cluster)
    assert f"winner: {pred.iteration_s:.2f} s/iteration" in text and "runners-up:" in text and "loses on:" in text


def test_roles_of_reads_the_graph():
    g, _ = api.load("ppo_rm")
    roles = roles_of(g)
    assert roles.actor == "actor" and set(roles.models) == {"actor", "critic", "ref", "rm"}
    assert roles.trainable == {"actor", "critic"} and roles.role_of("rm") == "reward"


@pytest.mark.slow
def test_long_tails_favour_partial_rollouts_or_async():
    heavy = WorkloadSpec(
        prompts_per_step=512, samples_per_prompt=4, prompt_length=512,
        response_length=LogNormal(median=256, sigma=1.4, max=8192),
    )  # fmt: skip
    best = make_tuner("grpo", MODEL_PRESETS["qwen2.5-7b"], "32xH100-80G", heavy).search(budget_s=5).best
    assert best.rollout.partial or best.rollout.mode != "sync", best.summary()


# ------------------------------------------------------------------ the simulation settings behind the ranking


@pytest.fixture(scope="module")
def llama7b_on_128():
    t = make_tuner("ppo_rm", MODEL_PRESETS["llama-7b"], "128xA100-80G", WorkloadSpec())
    return t, t.search(budget_s=8)


@pytest.mark.slow
def test_sampling_generation_replicas_leaves_training_alone(llama7b_on_128):
    t, result = llama7b_on_128
    many = next(c.plan for c in result.ranked if c.plan.generation.replicas > FINAL["max_replicas"])
    plan = msgspec.structs.replace(many, predicted=None)
    full = t.evaluate(plan, iterations=3, max_replicas=None).result
    for sampled in (t.evaluate(plan, iterations=3, max_replicas=8).result, t.evaluate(plan, **FINAL).result):
        for node in ("old_logprobs", "score", "train_actor", "train_critic"):
            assert sampled.breakdown[node] == pytest.approx(full.breakdown[node], rel=1e-9), node
        assert sampled.flops == pytest.approx(full.flops, rel=0.05)


@pytest.mark.slow
def test_the_winners_prediction_survives_a_full_simulation(llama7b_on_128):
    t, result = llama7b_on_128
    winner = msgspec.structs.replace(result.best, predicted=None)
    full = t.evaluate(winner, iterations=30, max_replicas=None).result.iteration_s
    assert full <= 1.05 * result.best.predicted.iteration_s, (full, result.best.predicted.iteration_s)


# ------------------------------------------------------------------ 2. determinism

TAIL = WorkloadSpec(
    prompts_per_step=256, samples_per_prompt=4, prompt_length=512,
    response_length=LogNormal(median=512, sigma=1.2, max=8192),
)  # fmt: skip


@pytest.mark.slow
def test_same_seed_same_plans_and_predictions():
    args = ("ppo_rm", MODEL_PRESETS["llama-7b"], "16xA100-80G", TAIL)
    a, b = (make_tuner(*args, seed=5).search(budget_s=2) for _ in range(2))
    assert a.best == b.best  # predictions included
    ranking = [(c.plan, c.result.iteration_s, c.memory) for c in a.ranked]
    assert ranking == [(c.plan, c.result.iteration_s, c.memory) for c in b.ranked]
    assert a.considered == b.considered


@pytest.mark.slow
def test_same_seed_same_plan_id_through_the_api():
    target = ClusterTarget(cluster=parse_cluster("16xA100-80G"), model=MODEL_PRESETS["qwen2.5-7b"], workload=TAIL)
    ids = {api.plan("grpo", target=target, options={"seed": 3, "budget_s": 30}, emit=quiet)[1].id for _ in range(2)}
    assert len(ids) == 1


@pytest.mark.slow
def test_other_seeds_only_move_the_sampled_times():
    def signature(result):
        return {c.plan.summary(): (c.memory, c.result.iteration_s) for c in result.ranked}

    def search(workload, seed):
        return make_tuner("grpo", MODEL_PRESETS["qwen2.5-7b"], "16xA100-80G", workload, seed=seed).search(budget_s=30)

    lognormal = [signature(search(TAIL, s)) for s in (0, 1)]
    # the seed reaches the sampler (and, through micro-batch padding, which layouts win); a shared
    # candidate keeps its memory
    shared = set(lognormal[0]) & set(lognormal[1])
    assert all(lognormal[0][k][0] == lognormal[1][k][0] for k in shared)
    assert lognormal[0] != lognormal[1]
    fixed = msgspec.structs.replace(TAIL, response_length=Fixed(value=512))
    a, b = (search(fixed, s) for s in (0, 1))
    assert a.best == b.best and signature(a) == signature(b)  # nothing sampled: the seed changes nothing


# ------------------------------------------------------------------ 3. the time budget (a fake clock, no wall clock)


class FakeClock:
    """perf_counter for the autotune module: ``step`` seconds pass on every read."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 0.0, step

    def perf_counter(self) -> float:
        self.now += self.step
        return self.now


@pytest.mark.slow
def test_the_plan_does_not_depend_on_the_machines_speed(monkeypatch):
    args = ("ppo_rm", MODEL_PRESETS["llama-7b"], "16xA100-80G", WorkloadSpec())
    monkeypatch.setattr(autotune, "time", FakeClock(step=1e-6))  # a machine that never runs out of budget
    fast = make_tuner(*args).search(budget_s=8)
    monkeypatch.setattr(autotune, "time", FakeClock(step=1.0))  # a machine where each candidate takes a second
    slow = make_tuner(*args).search(budget_s=8)
    assert slow.considered < fast.considered  # the budget was binding ...
    assert slow.best.summary() == fast.best.summary()  # ... and the plan is still the same


def test_search_stops_when_the_budget_is_spent(monkeypatch):
    monkeypatch.setattr(autotune, "time", FakeClock(step=10.0))  # every clock read: the budget is long gone
    result = make_tuner("grpo", QWEN, "2xA100-80G", load(64)).search(budget_s=0.5)
    assert result.considered <= 8, result.considered


@pytest.mark.parametrize(
    ("graph", "model", "cluster", "workload"),
    [
        ("grpo", TINY, "1xA100-80G", load(4)),
        pytest.param("ppo_rm", MODEL_PRESETS["llama-7b"], "16xA100-80G", WorkloadSpec(), marks=pytest.mark.slow),
    ],
    ids=["exhaustive-space", "greedy-space"],
)
def test_an_unlimited_budget_simulates_every_candidate_however_slow_the_machine(
    monkeypatch, graph, model, cluster, workload
):
    """``budget_s=inf`` (`flowrl plan --budget all`): every candidate is simulated on a machine where each
    takes ten seconds, and the pick is the one a machine that never runs out of budget makes."""
    monkeypatch.setattr(autotune, "time", FakeClock(step=10.0))
    slow = make_tuner(graph, model, cluster, workload).search(budget_s=math.inf)
    monkeypatch.setattr(autotune, "time", FakeClock(step=1e-9))
    fast = make_tuner(graph, model, cluster, workload).search(budget_s=1e6)
    assert slow.considered == fast.considered > 8
    assert slow.best.summary() == fast.best.summary()


@pytest.mark.slow
def test_the_greedy_path_stops_when_the_budget_is_spent(monkeypatch):
    """The non-exhaustive path honours the budget: one quick candidate, then the final ranking."""
    monkeypatch.setattr(autotune, "time", FakeClock(step=10.0))
    result = make_tuner("ppo_rm", MODEL_PRESETS["llama-7b"], "128xA100-80G", WorkloadSpec()).search(budget_s=0.5)
    assert result.considered == 1 and result.best.predicted is not None
    assert result.seconds > 0.5  # the fake clock is the one the result reports


# ------------------------------------------------------------------ 4. numerics and executor capabilities


def test_the_tuner_checks_memory_with_the_backends_numerics():
    """Capacity, states, activations and generation all come from flowrl.planner.memory under the
    tuner's Numerics; a heavier numerics (fp32, no recomputation, eager attention) needs more."""
    heavy = mem.Numerics(
        weight_bytes=4, grad_bytes=4, optimizer_bytes=8, activation_bytes=4,
        recompute=False, eager_attention=True, decode_batch=None, reserve=0.2,
    )  # fmt: skip
    results = {}

    def need(t: Tuner, n: mem.Numerics, plan: ClusterPlan) -> dict[str, int]:
        trainable, out = t.roles.trainable, {}
        for g in plan.groups:
            members = [m for m in plan.models if m.group == g.name]
            states = {m.model: mem.state_bytes(QWEN, n, m, m.model in trainable) for m in members}
            peaks = {
                m.model: mem.activation_bytes(QWEN, n, m, t.max_len, training=m.model in trainable) for m in members
            }
            if plan.generation.group == g.name:
                peaks["gen"] = mem.generation_bytes(QWEN, n, plan.generation, t.w.sequences, t.max_len)
            out[g.name] = mem.group_need(states, peaks)[0]
        return out

    for name, numerics in (("default", None), ("heavy", heavy)):
        t = make_tuner("grpo", QWEN, "2xA100-80G", load(64), numerics=numerics)
        n = numerics or mem.Numerics()
        assert t.numerics == n and t.capacity == mem.usable_bytes(t.cluster.hardware, n)
        result = unbounded(t, exhaustive_limit=0)
        for c in result.ranked:
            assert c.memory == need(t, n, c.plan) and max(c.memory.values()) <= t.capacity, c.plan.summary()
        results[name] = (t, result)
    # the same plan needs more under the heavier numerics (each numerics' best plan may differ: fp32 is priced
    # at the fp32 peak)
    t, default = results["default"]
    plan = default.best
    assert max(need(t, heavy, plan).values()) > max(need(t, mem.Numerics(), plan).values())


def test_nothing_fits_names_the_numerics_bytes_per_parameter():
    fp32 = mem.Numerics(weight_bytes=4, grad_bytes=4, optimizer_bytes=8)
    t = make_tuner("grpo", MODEL_PRESETS["llama-7b"], mini(2, 16.0), load(8), numerics=fp32)
    with pytest.raises(PlanError) as info:
        t.search(budget_s=5)
    text = " ".join(str(info.value).split())
    assert "no plan fits" in text and "16 bytes/parameter per trainable model, 4 per frozen one" in text, text


LOCAL_LIKE = Capabilities(
    placements=("colocate",), rollout_modes=("sync",), partial_rollouts=False, weight_sync=("reshard",),
)  # fmt: skip
NO_OVERLAP = Capabilities(rollout_modes=("sync",), weight_sync=("full", "bucketed"))


@pytest.mark.parametrize("caps", [LOCAL_LIKE, NO_OVERLAP], ids=["colocate-sync-reshard", "sync-no-reshard"])
def test_the_search_stays_within_the_executors_placements_rollouts_and_syncs(caps):
    free = unbounded(make_tuner("grpo", QWEN, "4xA100-80G", load(64)), exhaustive_limit=0)
    t = make_tuner("grpo", QWEN, "4xA100-80G", load(64), capabilities=caps)
    result = unbounded(t, exhaustive_limit=0)
    assert result.ranked and result.considered < free.considered
    for c in result.ranked:
        p = c.plan
        assert p.placement in caps.placements and p.rollout.mode in caps.rollout_modes, p.summary()
        assert p.weight_sync.strategy in caps.weight_sync and (caps.partial_rollouts or not p.rollout.partial)
    # the restricted winner is one of the unrestricted candidates, and no faster than the unrestricted winner
    assert result.best.summary() in {c.plan.summary() for c in free.ranked}
    assert result.best.predicted.iteration_s >= free.best.predicted.iteration_s * (1 - 1e-9)


def test_an_executor_without_model_parallelism_gets_no_tp_or_pp():
    caps = Capabilities(model_parallel=False, pipeline_parallel=False)
    workload = WorkloadSpec(prompts_per_step=64, prompt_length=256, response_length=Fixed(value=256))
    t = make_tuner("grpo", MODEL_PRESETS["llama-7b"], "8xA100-80G", workload, capabilities=caps)
    result = t.search(budget_s=2)
    assert result.ranked and [c.plan.summary() for c in result.ranked if unsupported(caps, c.plan, 8)] == []
    # where no layout without model parallelism fits, the refusal says so instead of suggesting this cluster
    with pytest.raises(PlanError, match="the states fit here, so activations or the KV cache do not") as info:
        # 128K-token responses: one sequence's activations (paged KV needs only one in flight) outgrow a device
        long = WorkloadSpec(prompt_length=256, response_length=Fixed(value=131072))
        make_tuner("grpo", MODEL_PRESETS["llama-7b"], "8xA100-80G", long, capabilities=caps).search(budget_s=2)
    assert "--cluster 8xA100-80G" not in str(info.value)


def test_planning_for_the_backend_restricts_to_the_local_executor():
    """for_backend=True: the local executor's capabilities and numerics; a cluster larger than it runs
    is refused at plan time; the one-device plan fits the executor, which then refuses a model it does not build."""
    target = ClusterTarget(cluster=parse_cluster("2xA100-80G"), model=QWEN, workload=load(64))
    with pytest.raises(PlanError, match=r"runs at most 1 device\(s\); this cluster has 2"):
        api.plan("grpo", target=target, for_backend=True, options={"budget_s": 2}, emit=quiet)
    target = ClusterTarget(cluster=parse_cluster("1xA100-80G"), model=QWEN, workload=load(64))
    graph, plan = api.plan("grpo", target=target, for_backend=True, options={"budget_s": 2}, emit=quiet)
    caps = api.executor(plan).capabilities
    # what the executor places and schedules, composed with what the configured engines declared
    composed = of_config(caps, api.default_registry(), plan.config)
    # the executor's numerics as its engine computes on this GPU (auto: bf16 + SDPA)
    assert plan.models["actor"].numerics.dtype == "bfloat16"
    assert plan.target.numerics == engine_memory(caps.numerics, plan.models["actor"].numerics) != mem.Numerics()
    assert plan.target.capabilities == composed
    assert composed.placements == caps.placements and not composed.model_parallel
    lay = plan.layout
    assert (lay.placement, lay.rollout.mode, lay.rollout.partial, lay.weight_sync.strategy) == (
        "colocate", "sync", False, "reshard",
    )  # fmt: skip
    assert all(e.capacity_bytes == mem.usable_bytes(target.cluster.hardware, plan.target.numerics) for e in plan.memory)
    with pytest.raises(PlanError, match="the plan is for model 'qwen2.5-0.5b'"):  # ... but this config builds another
        api.check(graph, plan)


def test_a_one_device_cluster_has_the_one_colocated_layout_with_its_prediction():
    target = ClusterTarget(cluster=parse_cluster("1xA100-80G"), model=QWEN, workload=load(16))
    results = PassResults()
    graph, plan = api.plan("grpo", target=target, results=results, for_backend=True, emit=quiet)
    assert plan.passes == PIPELINE
    tune = results.place.tune
    assert tune.considered == 1 and len(tune.ranked) == 1 and tune.ranked[0].plan == plan.layout
    base = colocated(graph, plan.workload)  # the same layout; micro-batches halved until they fit
    fitted = msgspec.structs.replace(plan.layout, predicted=None)
    assert msgspec.structs.replace(fitted, models=base.models) == base
    for m, b in zip(fitted.models, base.models):
        assert 1 <= m.micro_batch <= b.micro_batch
    pred = plan.layout.predicted
    assert pred is not None and pred.iteration_s > 0 and set(pred.breakdown) == set(graph.nodes) | {"weight_sync"}
    assert set(pred.memory_bytes) == set(pred.utilization) == {"all"}
    # the same prediction as simulating that layout directly
    t = Tuner(
        graph, QWEN, target.cluster, plan.workload, numerics=plan.target.numerics, capabilities=plan.target.capabilities
    )
    assert t.single(fitted).ranked[0].plan == plan.layout


def test_a_one_device_plans_prediction_agrees_with_its_memory_estimate():
    target = ClusterTarget(cluster=parse_cluster("1xA100-80G"), model=QWEN, workload=WorkloadSpec())
    _, plan = api.plan("grpo", target=target, emit=quiet)
    capacity = mem.usable_bytes(target.cluster.hardware, target.numerics)
    assert all(e.required_bytes <= e.capacity_bytes == capacity for e in plan.memory)
    assert all(v <= capacity for v in plan.layout.predicted.memory_bytes.values()), plan.layout.predicted


def test_a_one_device_cluster_still_offloads_the_optimizer_when_that_fits():
    model = MODEL_PRESETS["qwen2.5-7b"]
    target = ClusterTarget(cluster=parse_cluster("1xA100-80G"), model=model, workload=WorkloadSpec())
    _, plan = api.plan("grpo", target=target, emit=quiet)
    assert plan.layout.layout("actor").offload_optimizer


# ------------------------------------------------------------------ 5. random targets: a plan that holds, or an error


def assert_plan_holds(g: Graph, plan: ExecutionPlan, target: ClusterTarget) -> None:
    """Every invariant a cluster plan promises, checked independently of verify_plan."""
    verify_plan(g, plan)
    cluster, spec, workload = target.cluster, target.model, target.workload
    assert plan.target == target and plan.passes == PIPELINE
    c = plan.layout
    assert sorted(m.model for m in c.models) == sorted(g.models)
    groups = {x.name: x for x in c.groups}
    assert len(groups) == len(c.groups) and sum(x.devices for x in c.groups) <= cluster.devices
    first = 0
    for x in c.groups:  # contiguous, non-overlapping device ranges
        assert x.first == first and x.devices >= 1
        first += x.devices
    batch = workload.sequences // workload.mini_batches
    for m in c.models:
        p = m.parallel
        assert p.dp * p.tp * p.pp == groups[m.group].devices, m
        assert spec.heads % p.tp == 0 and spec.layers % p.pp == 0, m
        assert p.tp <= cluster.devices_per_node, m
        assert batch % p.dp == 0 and (batch // p.dp) % m.micro_batch == 0, m
    gen = c.generation
    assert gen.tp * gen.replicas == groups[gen.group].devices and spec.heads % gen.tp == 0
    capacity = mem.usable_bytes(cluster.hardware, target.numerics)
    assert {e.group for e in plan.memory} == set(groups)
    assert all(0 < e.required_bytes <= e.capacity_bytes == capacity for e in plan.memory), (plan.memory, capacity)
    assert sorted(n.node for n in plan.nodes) == sorted(g.nodes)
    assert all(n.group is None or n.group in groups for n in plan.nodes)
    pred = c.predicted
    assert set(pred.memory_bytes) == set(groups) and all(v > 0 for v in pred.memory_bytes.values())
    if cluster.devices > 1:  # one device: see test_a_one_device_plans_prediction_agrees_with_its_memory_estimate
        assert all(v <= capacity for v in pred.memory_bytes.values()), (pred.memory_bytes, capacity)
    assert set(pred.breakdown) == set(g.nodes) | {"weight_sync"}
    assert all(v >= 0 for v in pred.breakdown.values())
    assert all(0 <= u <= 1 for u in pred.utilization.values()) and set(pred.utilization) == set(groups)
    assert math.isfinite(pred.iteration_s) and pred.iteration_s > 0
    assert 0 < pred.roofline_s <= pred.iteration_s * (1 + 1e-6) and 0 < pred.efficiency <= 1, pred


LENGTH = st.integers(16, 4096)
SIGMA = st.sampled_from([0.0, 0.5, 1.0, 1.5, 2.0])
RESPONSE = st.one_of(
    st.builds(lambda v: Fixed(value=v), LENGTH),
    st.builds(lambda m, s, x: LogNormal(median=m, sigma=s, max=x), LENGTH, SIGMA, LENGTH),
)


def agreeing(workload: WorkloadSpec) -> list[str]:
    """Run-config overrides that generate what the workload says (see
    test_the_memory_pass_sees_the_sequences_the_tuner_planned_for: they may not disagree yet)."""
    return [
        f"rollout.prompts_per_step={workload.prompts_per_step}",
        f"rollout.samples_per_prompt={workload.samples_per_prompt}",
    ]


# Tuner.search ignores budget_s on its exhaustive path (test_search_stops_when_the_budget_is_spent), where one
# draw can simulate 4000 plans; the property draws enumerate at most this many, so a draw costs about budget_s.
EXHAUSTIVE_CAP = 200
# CI (derandomized): the same 25 draws on every run; HYPOTHESIS_PROFILE=explore: the profile's count, at random
PROPERTY_EXAMPLES = 25 if settings.default.derandomize else settings.default.max_examples


@pytest.mark.slow
@settings(max_examples=PROPERTY_EXAMPLES)
@given(
    graph=st.sampled_from(GRAPHS),
    model=st.sampled_from(sorted(MODEL_PRESETS)),
    devices=st.sampled_from([1, 2, 4, 8, 16, 32, 64]),
    hardware=st.sampled_from(sorted(HARDWARE_PRESETS)),
    prompts=st.integers(8, 2048),
    samples=st.integers(1, 8),
    prompt_len=LENGTH,
    response=RESPONSE,
)
def test_random_targets_plan_or_fail_cleanly(graph, model, devices, hardware, prompts, samples, prompt_len, response):
    g, _ = api.load(graph)
    cluster = parse_cluster(f"{devices}x{hardware}")
    workload = WorkloadSpec(
        prompts_per_step=prompts, samples_per_prompt=samples, prompt_length=prompt_len, response_length=response,
    )  # fmt: skip
    target = ClusterTarget(cluster=cluster, model=MODEL_PRESETS[model], workload=workload)
    search = Tuner.search
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(Tuner, "search", lambda self, **kw: search(self, **{"exhaustive_limit": EXHAUSTIVE_CAP, **kw}))
            options = {"budget_s": 0.5}
            _, plan = api.plan(graph, target=target, options=options, emit=quiet, overrides=agreeing(workload))
    except PlanError as exc:  # nothing fits: say so, with numbers
        text = " ".join(str(exc).split())
        assert "no plan fits" in text and "GiB" in text and "--cluster" in text, text
        event("no plan fits")
        return
    event(f"planned: {plan.layout.placement}")
    assert_plan_holds(g, plan, target)


def test_the_memory_pass_sees_the_sequences_the_tuner_planned_for():
    length = Fixed(value=995)
    workload = WorkloadSpec(prompts_per_step=8, samples_per_prompt=1, prompt_length=16, response_length=length)
    target = ClusterTarget(cluster=parse_cluster("2xA100-80G"), model=MODEL_PRESETS["llama-13b"], workload=workload)
    graph, plan = api.plan("grpo", target=target, emit=quiet)  # the run config of grpo samples 16 per prompt
    assert plan.node("rollout").rows == workload.sequences
    assert_plan_holds(graph, plan, target)


def test_roofline_is_a_lower_bound_under_a_long_tail():
    length = LogNormal(median=16, sigma=2.0, max=4096)
    workload = WorkloadSpec(prompts_per_step=8, samples_per_prompt=1, prompt_length=16, response_length=length)
    for devices in (1, 2):
        target = ClusterTarget(cluster=parse_cluster(f"{devices}xA100-80G"), model=QWEN, workload=workload)
        _, plan = api.plan("grpo", target=target, options={"budget_s": 0.5}, emit=quiet)
        pred = plan.layout.predicted
        assert pred.roofline_s <= pred.iteration_s and pred.efficiency <= 1, (devices, pred)


# ------------------------------------------------------------------ 6. the shipped sizes (speed: benchmarks/planner.py)

INFEASIBLE_OK = {("llama-34b", 16), ("llama-70b", 16), ("llama-70b", 32)}  # may honestly not fit


@pytest.mark.parametrize(
    ("model", "devices"),
    [
        (m, d) if (m, d) == ("llama-7b", 16) else pytest.param(m, d, marks=pytest.mark.slow)  # one in the quick lane
        for m in ("llama-7b", "llama-13b", "llama-34b", "llama-70b")
        for d in (16, 32, 64, 128)
    ],
)
@pytest.mark.slow
def test_ppo_with_a_reward_model_plans_for_llama_on_a100_80g(model, devices):
    cluster = parse_cluster(f"{devices}xA100-80G")
    target = ClusterTarget(cluster=cluster, model=MODEL_PRESETS[model], workload=WorkloadSpec())
    try:
        graph, plan = api.plan("graphs/ppo_rm.py", target=target, emit=quiet)
    except PlanError as exc:
        assert (model, devices) in INFEASIBLE_OK, str(exc)
        assert "no plan fits" in str(exc)
        return
    assert_plan_holds(graph, plan, target)
    pred = plan.layout.predicted
    assert all(pred.breakdown[k] > 0 for k in ("rollout", "train_actor", "train_critic", "score"))
    assert sum(g.devices for g in plan.layout.groups) == devices


@pytest.mark.slow
def test_an_engine_computing_in_float32_is_priced_at_the_fp32_peak():
    """The time model takes the precision the engine computes in: an A100's fp32 peak is 16x below its bf16."""
    model, cluster = MODEL_PRESETS["qwen2.5-0.5b"], "1x8xA100-80G"
    fp32 = mem.Numerics(weight_bytes=4, grad_bytes=4, optimizer_bytes=8, activation_bytes=4)
    bf16 = mem.Numerics()
    slow = make_tuner("grpo", model, cluster, load(64), numerics=fp32).search(budget_s=1.0)
    fast = make_tuner("grpo", model, cluster, load(64), numerics=bf16).search(budget_s=1.0)
    hw = HARDWARE_PRESETS["A100-80G"]
    assert slow.roofline["peak_flops"] == hw.peak_flops_fp32 and fast.roofline["peak_flops"] == hw.peak_flops_bf16
    assert slow.ranked[0].result.iteration_s > 1.2 * fast.ranked[0].result.iteration_s  # its matmuls, not decode
    assert f"{hw.peak_flops_fp32 / 1e12:.3g} TFLOP/s" in explain(slow, model, parse_cluster(cluster))
