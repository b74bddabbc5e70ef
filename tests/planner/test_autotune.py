"""The cluster auto-tuner: exact optimum on enumerable spaces, determinism, random-input
invariants, the shipped-size timing targets.

Brute force here builds the plan space independently of the tuner's search: every skeleton,
the product of every model's layout options on its group, the memory check, and the same
simulation settings as the tuner's final ranking (``autotune.FINAL``).
"""

from __future__ import annotations

import itertools
import math
import time

import msgspec
import pytest
from hypothesis import HealthCheck, event, given, seed, settings
from hypothesis import strategies as st

import flowrl.planner.autotune as autotune
from flowrl import api
from flowrl.errors import PlanError
from flowrl.planner.autotune import FINAL, Tuner, explain, roles_of
from flowrl.planner.cost import RESERVE
from flowrl.planner.hardware import HARDWARE_PRESETS, ClusterSpec, parse_cluster
from flowrl.planner.modelspec import MODEL_PRESETS, ModelSpec
from flowrl.planner.passes import verify_cluster_plan
from flowrl.planner.plan import ClusterTarget
from flowrl.planner.space import ClusterPlan, ModelLayout, layouts, skeletons
from flowrl.planner.workload import Fixed, LogNormal, WorkloadSpec

GiB = 1024**3
QWEN = MODEL_PRESETS["qwen2.5-0.5b"]
# heads 2 / kv 1 / 2 layers: tp and pp in {1, 2}, so brute force over raw layouts stays cheap
TINY = ModelSpec(name="tiny", layers=2, hidden=2048, heads=2, kv_heads=1, intermediate=5632, vocab=32000)
# one head, one layer: only dp, micro-batch and offload vary
TINY1 = ModelSpec(name="tiny1", layers=1, hidden=2048, heads=1, kv_heads=1, intermediate=5632, vocab=32000)


def load(prompts: int, *, samples: int = 1) -> WorkloadSpec:
    return WorkloadSpec(prompts_per_step=prompts, samples_per_prompt=samples, prompt_length=256, response_length=LogNormal(median=128, sigma=0.8, max=1024))


def mini(devices: int, memory_gib: float) -> ClusterSpec:
    """One node of A100-80G-like devices with ``memory_gib`` of memory each (memory pressure on tiny models)."""
    hw = msgspec.structs.replace(HARDWARE_PRESETS["A100-80G"], name=f"mini-{memory_gib:g}G", memory_bytes=int(memory_gib * GiB))
    return ClusterSpec(nodes=1, devices_per_node=devices, hardware=hw)


def make_tuner(graph: str, model: ModelSpec, cluster: ClusterSpec | str, workload: WorkloadSpec, seed: int = 0) -> Tuner:
    g, _ = api.load(graph)
    return Tuner(g, model, parse_cluster(cluster) if isinstance(cluster, str) else cluster, workload, seed=seed)


def raw_options(t: Tuner, model: str, group) -> list[tuple[ModelLayout, float, int, int]]:
    """Every layout space.layouts() offers, unpruned, as (layout, 0, static bytes, activation bytes)."""
    trainable = model in t.roles.trainable
    out = []
    for lay in layouts(model, group, trainable=trainable, per_node=t.cluster.devices_per_node, heads=t.model.heads, kv_heads=t.model.kv_heads, layers=t.model.layers, batch=t.w.sequences // t.w.mini_batches):
        out.append((lay, 0.0, t.cost.static_bytes(lay, trainable), t.cost.activation_bytes(lay, t.max_len, training=trainable)))
    return out


def brute_force(t: Tuner, *, raw: bool) -> tuple[float, ClusterPlan | None, int]:
    """(best final-settings iteration time, its plan, number of fitting plans) over the whole space."""
    best, best_plan, fitting = math.inf, None, 0
    for sk in skeletons(t.roles, t.cluster.devices, t.cluster.devices_per_node, t.model.heads, t.model.kv_heads):
        groups = {g.name: g for g in sk.groups}
        per_model = [(raw_options(t, m, groups[g]) if raw else t.options(m, groups[g])) for m, g in sk.assignment]
        for combo in itertools.product(*per_model):
            choice = {m: c for (m, _), c in zip(sk.assignment, combo)}
            if any(t.group_memory(sk, choice, g.name)[0] > t.cost.capacity for g in sk.groups):
                continue
            plan = ClusterPlan(placement=sk.placement, groups=sk.groups, models=tuple(choice[m][0] for m in t.roles.models), generation=sk.generation, rollout=sk.rollout, weight_sync=sk.weight_sync)
            cand = t.evaluate(plan, **FINAL)
            assert max(cand.memory.values()) <= t.cost.capacity
            fitting += 1
            if cand.result.iteration_s < best:
                best, best_plan = cand.result.iteration_s, plan
    return best, best_plan, fitting


def test_final_ranking_settings_are_the_documented_ones():
    assert FINAL == {"iterations": 5, "max_replicas": 32}


# ------------------------------------------------------------------ 1. the optimum on enumerable spaces

EXACT = [
    # (graph, model, cluster, workload, also brute-force the raw layouts)
    pytest.param("grpo", QWEN, "2xA100-80G", load(64), True, id="grpo-qwen0.5b-2xA100-80G"),
    pytest.param("grpo", QWEN, "4xA100-80G", load(64), False, id="grpo-qwen0.5b-4xA100-80G"),
    pytest.param("ppo_rm", TINY1, "4xA100-80G", load(4), True, id="ppo_rm-tiny-4xA100-80G"),
    pytest.param("grpo", TINY, mini(4, 4.0), load(2), True, id="grpo-tiny-4x4GiB-memory-bound"),
    pytest.param("rloo", TINY, mini(2, 2.0), load(8), True, id="rloo-tiny-2x2GiB-memory-bound"),
]


@pytest.mark.parametrize("graph, model, cluster, workload, raw", EXACT)
def test_search_returns_the_simulators_optimum(graph, model, cluster, workload, raw):
    t = make_tuner(graph, model, cluster, workload)
    result = t.search(budget_s=60)
    found = result.ranked[0].result.iteration_s
    best, plan, fitting = brute_force(make_tuner(graph, model, cluster, workload), raw=False)
    assert fitting > 0
    assert found == pytest.approx(best, rel=1e-9), (result.best.summary(), plan.summary())
    assert result.best.predicted.iteration_s == pytest.approx(best, abs=1e-6)
    if raw:  # Pareto pruning is safe: the raw layouts hold nothing more than 1% faster
        raw_best, raw_plan, raw_fitting = brute_force(make_tuner(graph, model, cluster, workload), raw=True)
        assert raw_fitting >= fitting
        assert raw_best >= found / 1.01, (result.best.summary(), raw_plan.summary())


def test_pareto_pruning_is_safe_when_the_actor_layout_drives_the_weight_sync():
    cluster, workload = mini(4, 2.0), load(2)
    found = make_tuner("grpo", TINY, cluster, workload).search(budget_s=60).ranked[0].result.iteration_s
    raw_best, raw_plan, _ = brute_force(make_tuner("grpo", TINY, cluster, workload), raw=True)
    assert raw_best >= found / 1.01, (found, raw_best, raw_plan.summary())


@pytest.mark.xfail(
    strict=True,
    reason=(
        "BUG autotune.py Tuner._combinations counts every layout combination, fitting or not, against exhaustive_limit, "
        "so memory-bound spaces with a handful of fitting plans fall back to the greedy fit(), which misses the optimum"
    ),
)
@pytest.mark.parametrize(
    "model, devices, memory, prompts",
    [pytest.param(TINY1, 2, 2.0, 8, id="8-fitting-plans"), pytest.param(TINY, 2, 2.0, 8, id="340-fitting-plans")],
)
def test_memory_bound_ppo_rm_spaces_are_solved_exactly(model, devices, memory, prompts):
    cluster, workload = mini(devices, memory), load(prompts)
    found = make_tuner("ppo_rm", model, cluster, workload).search(budget_s=60).ranked[0].result.iteration_s
    best, plan, fitting = brute_force(make_tuner("ppo_rm", model, cluster, workload), raw=False)
    assert fitting <= 4000  # small enough to enumerate
    assert found == pytest.approx(best, rel=1e-9), (found, best, plan.summary())


def test_greedy_fit_stays_close_to_the_optimum_on_memory_bound_spaces():
    """Where the tuner is not exact (above), it is at least within 2%."""
    for model, prompts in ((TINY1, 8), (TINY, 8)):
        cluster, workload = mini(2, 2.0), load(prompts)
        found = make_tuner("ppo_rm", model, cluster, workload).search(budget_s=60).ranked[0].result.iteration_s
        best, _, _ = brute_force(make_tuner("ppo_rm", model, cluster, workload), raw=False)
        assert best <= found <= 1.02 * best, (model.name, found, best)


def test_ranking_is_sorted_and_the_winner_is_sealed_with_a_consistent_prediction():
    t = make_tuner("ppo_rm", MODEL_PRESETS["llama-7b"], "32xA100-80G", WorkloadSpec(response_length=LogNormal(median=512, sigma=1.0, max=4096)))
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
    assert 0 < pred.roofline_s <= pred.iteration_s and pred.efficiency == pytest.approx(pred.roofline_s / pred.iteration_s, abs=1e-3)
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


# ------------------------------------------------------------------ the simulation settings behind the ranking


@pytest.fixture(scope="module")
def llama7b_on_128():
    t = make_tuner("ppo_rm", MODEL_PRESETS["llama-7b"], "128xA100-80G", WorkloadSpec())
    return t, t.search(budget_s=8)


def test_sampling_generation_replicas_leaves_training_alone(llama7b_on_128):
    t, result = llama7b_on_128
    many = next(c.plan for c in result.ranked if c.plan.generation.replicas > FINAL["max_replicas"])
    plan = msgspec.structs.replace(many, predicted=None)
    full = t.evaluate(plan, iterations=3, max_replicas=None).result
    for sampled in (t.evaluate(plan, iterations=3, max_replicas=8).result, t.evaluate(plan, **FINAL).result):
        for node in ("old_logprobs", "score", "train_actor", "train_critic"):
            assert sampled.breakdown[node] == pytest.approx(full.breakdown[node], rel=1e-9), node
        assert sampled.flops == pytest.approx(full.flops, rel=0.05)


def test_the_winners_prediction_survives_a_full_simulation(llama7b_on_128):
    t, result = llama7b_on_128
    winner = msgspec.structs.replace(result.best, predicted=None)
    full = t.evaluate(winner, iterations=30, max_replicas=None).result.iteration_s
    assert full <= 1.05 * result.best.predicted.iteration_s, (full, result.best.predicted.iteration_s)


# ------------------------------------------------------------------ 2. determinism

TAIL = WorkloadSpec(prompts_per_step=256, samples_per_prompt=4, prompt_length=512, response_length=LogNormal(median=512, sigma=1.2, max=8192))


def test_same_seed_same_plans_and_predictions():
    runs = [make_tuner("ppo_rm", MODEL_PRESETS["llama-7b"], "16xA100-80G", TAIL, seed=5).search(budget_s=30) for _ in range(2)]
    a, b = runs
    assert a.best == b.best  # predictions included
    assert [(c.plan, c.result.iteration_s, c.memory) for c in a.ranked] == [(c.plan, c.result.iteration_s, c.memory) for c in b.ranked]
    assert a.considered == b.considered


def test_same_seed_same_plan_id_through_the_api():
    target = ClusterTarget(cluster=parse_cluster("16xA100-80G"), model=MODEL_PRESETS["qwen2.5-7b"], workload=TAIL)
    ids = {api.plan("grpo", target=target, options={"seed": 3, "budget_s": 30}, emit=lambda s: None)[1].id for _ in range(2)}
    assert len(ids) == 1


def test_other_seeds_only_move_the_sampled_times():
    def signature(result):
        return {c.plan.summary(): (c.memory, c.result.iteration_s) for c in result.ranked}

    lognormal = [signature(make_tuner("grpo", MODEL_PRESETS["qwen2.5-7b"], "16xA100-80G", TAIL, seed=s).search(budget_s=30)) for s in (0, 1)]
    assert set(lognormal[0]) == set(lognormal[1])  # the same candidates ...
    assert all(lognormal[0][k][0] == lognormal[1][k][0] for k in lognormal[0])  # ... with the same memory
    assert any(lognormal[0][k][1] != lognormal[1][k][1] for k in lognormal[0])  # the seed reaches the sampler
    fixed = msgspec.structs.replace(TAIL, response_length=Fixed(value=512))
    a, b = (make_tuner("grpo", MODEL_PRESETS["qwen2.5-7b"], "16xA100-80G", fixed, seed=s).search(budget_s=30) for s in (0, 1))
    assert a.best == b.best and signature(a) == signature(b)  # nothing sampled: the seed changes nothing


class FakeClock:
    """perf_counter for the autotune module: ``step`` seconds pass on every read."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 0.0, step

    def perf_counter(self) -> float:
        self.now += self.step
        return self.now


def test_the_plan_does_not_depend_on_the_machines_speed(monkeypatch):
    args = ("ppo_rm", MODEL_PRESETS["llama-7b"], "128xA100-80G", WorkloadSpec())
    fast = make_tuner(*args).search(budget_s=8).best
    monkeypatch.setattr(autotune, "time", FakeClock(step=1.0))  # a machine where each candidate takes a second
    slow = make_tuner(*args).search(budget_s=8).best
    assert slow.summary() == fast.summary()


@pytest.mark.xfail(
    strict=True,
    reason=(
        "BUG autotune.py Tuner.search: on the exhaustive path (combos is not None) every candidate is simulated with the "
        "FINAL settings without looking at budget_s (remax qwen2.5-7b 4xA100-80G, 1898x6 prompts: budget_s=0.5 takes ~32 s)"
    ),
)
def test_search_stops_when_the_budget_is_spent(monkeypatch):
    monkeypatch.setattr(autotune, "time", FakeClock(step=10.0))  # every clock read: the budget is long gone
    result = make_tuner("grpo", QWEN, "2xA100-80G", load(64)).search(budget_s=0.5)
    assert result.considered <= 8, result.considered


def test_the_greedy_path_stops_when_the_budget_is_spent(monkeypatch):
    """The non-exhaustive path honours the budget: one quick candidate, then the final ranking."""
    monkeypatch.setattr(autotune, "time", FakeClock(step=10.0))
    result = make_tuner("ppo_rm", MODEL_PRESETS["llama-7b"], "128xA100-80G", WorkloadSpec()).search(budget_s=0.5)
    assert result.considered == 1 and result.best.predicted is not None


# ------------------------------------------------------------------ 3. random inputs: a plan that holds, or a PlanError

GRAPHS = ["ppo", "ppo_rm", "grpo", "rloo", "remax", "reinforce_pp"]
PROPERTY_SEED = int(__import__("os").environ.get("FLOWRL_PROPERTY_SEED", "1"))
LENGTH = st.integers(16, 4096)
RESPONSE = st.one_of(
    st.builds(lambda v: Fixed(value=v), LENGTH),
    st.builds(lambda m, s, x: LogNormal(median=m, sigma=s, max=x), LENGTH, st.sampled_from([0.0, 0.5, 1.0, 1.5, 2.0]), LENGTH),
)


# A fixed seed keeps the runtime predictable: search() ignores budget_s on small spaces (see
# test_search_stops_when_the_budget_is_spent), so an unlucky draw can take 30 s. Remove @seed
# locally to explore new examples.
@seed(PROPERTY_SEED)
@settings(max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
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
    spec = MODEL_PRESETS[model]
    cluster = parse_cluster(f"{devices}x{hardware}")
    workload = WorkloadSpec(prompts_per_step=prompts, samples_per_prompt=samples, prompt_length=prompt_len, response_length=response)
    target = ClusterTarget(cluster=cluster, model=spec, workload=workload)
    try:
        _, plan = api.plan(graph, target=target, options={"budget_s": 0.5}, emit=lambda s: None)
    except PlanError as exc:  # nothing fits: say so, with numbers
        text = " ".join(str(exc).split())
        assert "no plan fits" in text and "GiB" in text, text
        event("no plan fits")
        return
    event(f"planned: {plan.cluster.placement}")
    verify_cluster_plan(g, plan)
    c = plan.cluster
    assert plan.target == target and "autotune" in plan.passes
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
    pred = c.predicted
    capacity = int(cluster.hardware.memory_bytes * (1 - RESERVE))
    assert set(pred.memory_bytes) == set(groups)
    assert all(0 < v <= capacity for v in pred.memory_bytes.values()), (pred.memory_bytes, capacity)
    assert set(pred.breakdown) == set(g.nodes) | {"weight_sync"}
    assert all(v >= 0 for v in pred.breakdown.values())
    assert all(0 <= u <= 1 for u in pred.utilization.values()) and set(pred.utilization) == set(groups)
    assert math.isfinite(pred.iteration_s) and pred.iteration_s > 0
    assert pred.roofline_s > 0 and pred.efficiency > 0
    if isinstance(response, Fixed):  # lognormal: see test_roofline_is_a_lower_bound_under_a_long_tail
        assert pred.roofline_s <= pred.iteration_s * (1 + 1e-6) and pred.efficiency <= 1, (pred.roofline_s, pred.iteration_s)


def test_roofline_is_a_lower_bound_under_a_long_tail():
    workload = WorkloadSpec(prompts_per_step=8, samples_per_prompt=1, prompt_length=16, response_length=LogNormal(median=16, sigma=2.0, max=4096))
    target = ClusterTarget(cluster=parse_cluster("1xA100-80G"), model=QWEN, workload=workload)
    _, plan = api.plan("grpo", target=target, options={"budget_s": 0.5}, emit=lambda s: None)
    pred = plan.cluster.predicted
    assert pred.roofline_s <= pred.iteration_s and pred.efficiency <= 1, (pred.roofline_s, pred.iteration_s)


# ------------------------------------------------------------------ 5. the shipped-size targets

INFEASIBLE_OK = {("llama-34b", 16), ("llama-70b", 16), ("llama-70b", 32)}  # may honestly not fit


@pytest.mark.slow
@pytest.mark.parametrize("devices", [16, 32, 64, 128])
@pytest.mark.parametrize("model", ["llama-7b", "llama-13b", "llama-34b", "llama-70b"])
def test_ppo_with_a_reward_model_plans_in_under_10s(model, devices):
    target = ClusterTarget(cluster=parse_cluster(f"{devices}xA100-80G"), model=MODEL_PRESETS[model], workload=WorkloadSpec())
    t0 = time.perf_counter()
    try:
        graph, plan = api.plan("graphs/ppo_rm.py", target=target, emit=lambda s: None)
    except PlanError as exc:
        assert time.perf_counter() - t0 < 10
        assert (model, devices) in INFEASIBLE_OK, str(exc)
        assert "no plan fits" in str(exc)
        return
    seconds = time.perf_counter() - t0
    assert seconds < 10, seconds
    pred = plan.cluster.predicted
    assert set(pred.breakdown) == set(graph.nodes) | {"weight_sync"}
    assert all(v > 0 for k, v in pred.breakdown.items() if k in ("rollout", "train_actor", "train_critic", "score"))
    assert 0 < pred.efficiency <= 1 and pred.iteration_s > 0
    assert all(v <= target.cluster.hardware.memory_bytes for v in pred.memory_bytes.values())
    assert plan.target.cluster.devices == devices and sum(g.devices for g in plan.cluster.groups) == devices
