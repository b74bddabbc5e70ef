"""Tensor parallelism, planner against runtime: the planner's in-place decision
agrees with the schedule, memory and simulator; the generation group deals one shard per tp replica;
the worker moves each rank's own slices when the splits match, never the whole model; the planner
offers only tp sizes the engine splits."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flowrl import api
from flowrl.errors import FlowRLError
from flowrl.planner.constraints import parse_requirements
from flowrl.plugins.manager import registry
from flowrl.runtime.schedule import lower

REPO = Path(__file__).resolve().parents[2]
SMALL = ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=2", "progress=false", "checkpoint=false"]


@pytest.fixture
def ray_plugin(monkeypatch):
    """The Ray executor's entry point (what `flowrl plan --cluster cpu:N` plans for); no Ray is started."""
    from flowrl.plugins.manager import set_registry

    monkeypatch.setenv("FLOWRL_PLUGINS", "ray")
    set_registry(None)
    yield
    set_registry(None)


def plan_for(graph: str, devices: int, *require: str, extra: tuple[str, ...] = ()):
    """A plan of ``graph`` for this machine as ``devices`` CPU devices (the Ray executor's), with ``require``."""
    overrides = [*SMALL, "backend=ray", "device=cpu", *extra]
    g, cfg = api.load(graph, overrides=overrides)
    target = api.local_target(cfg, registry(), devices=devices)
    need = parse_requirements(require, g.models)
    return api.plan(
        graph, overrides=overrides, target=target, for_backend=True, options={"require": need}, emit=lambda s: None
    )


# ------------------------------------------------------------ planner vs runtime: in place


@pytest.mark.parametrize(
    ("devices", "require", "in_place"),
    [
        (2, ("actor.tp=2", "generation.tp=2"), True),  # dp1 tp2 trained, sampled tp2 on its own ranks
        (2, ("actor.dp=2", "generation.tp=2"), False),  # dp2 -> a tp2 replica: a reshard
        (2, ("actor.tp=2", "generation.tp=1"), False),  # tp2 -> two whole replicas
        (4, ("actor.dp=2", "actor.tp=2", "generation.tp=2"), False),  # dp2 x tp2: slices over dp
    ],
)
def test_the_planner_and_the_schedule_agree_on_sampling_in_place(ray_plugin, devices, require, in_place):
    """`schedule.lower` (what the runtime runs), the planner's memory pass and the simulator (no sync
    priced for a policy sampling in place) take the same in-place decision for tp layouts."""
    from flowrl.planner.passes import _generates_in_place

    graph, plan = plan_for("grpo", devices, *require)
    layout = plan.layout
    sched = lower(graph, plan, same_engine=True)
    gen = layout.generation_of("actor")
    assert sched.placement("actor").in_place is in_place
    assert _generates_in_place(plan, layout, "actor", gen.group) is in_place
    sync_s = layout.predicted.breakdown.get("weight_sync", 0.0)
    assert (sync_s == 0.0) is in_place, sync_s


# ------------------------------------------------------------ the generation group's dispatch


class _Recorder:
    """A transport that records each call and answers every rank with a one-row rollout per prompt."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], str, list[tuple]]] = []

    def call(self, ranks, method, args, tag):
        self.calls.append((list(ranks), method, list(args)))
        return [(r, a) for r, a in zip(ranks, args)]


def _group(tp: int, ranks=(0, 1, 2, 3)):
    from flowrl.runtime.groups import GenerationGroup

    t = _Recorder()
    return GenerationGroup("actor", ranks, t, pad_id=0, tp=tp), t


def test_generation_group_deals_one_shard_per_tp_replica_and_every_rank_of_it_takes_the_same_call(monkeypatch):
    from flowrl.data import Rollout

    seen = []
    monkeypatch.setattr(Rollout, "concat", staticmethod(lambda parts, pad, offsets: seen.append((parts, offsets))))
    group, t = _group(tp=2)
    assert group.replicas == [(0, 1), (2, 3)]
    group.generate(list("abc"), n=2, greedy=False, generator=torch.Generator().manual_seed(0))
    ranks, method, args = t.calls[-1]
    assert (ranks, method) == ([0, 1, 2, 3], "generate")
    assert args[0] == args[1] and args[2] == args[3]  # a replica's ranks sample alike (one seed)
    assert args[0][1] == ["a", "b"] and args[2][1] == ["c"]
    assert args[0][4] != args[2][4]  # the replicas draw differently
    parts, offsets = seen[-1]
    assert [p[0] for p in parts] == [0, 2] and offsets == [0, 2]  # each replica's first rank answers


def test_generation_group_with_fewer_prompts_than_replicas_calls_only_the_replicas_it_uses(monkeypatch):
    from flowrl.data import Rollout

    seen = []
    monkeypatch.setattr(Rollout, "concat", staticmethod(lambda parts, pad, offsets: seen.append((parts, offsets))))
    group, t = _group(tp=2)
    group.generate(["only"], n=4, greedy=True, generator=torch.Generator().manual_seed(0))
    ranks, _, args = t.calls[-1]
    assert ranks == [0, 1] and len(args) == 2 and args[0] == args[1]
    assert [p[0] for p in seen[-1][0]] == [0]
    group.generate([], n=4, greedy=True, generator=torch.Generator().manual_seed(0))  # none: one replica, no rows
    assert t.calls[-1][0] == [0, 1]


# ------------------------------------------------------------ the worker's per-rank slice sync


class _Trainer:
    tp, lora = 2, None

    def __init__(self) -> None:
        self.exported = self.sliced = 0

    def export_weights(self):
        self.exported += 1
        return {"w": torch.zeros(4, 4)}

    def export_local_shards(self):
        self.sliced += 1
        return {"w": torch.zeros(2, 4)}


class _Replica:
    def __init__(self) -> None:
        self.loaded = []

    def load_local_shards(self, shards, version):
        self.loaded.append(("shards", version, {k: tuple(v.shape) for k, v in shards.items()}))

    def load_weights(self, weights, version):
        self.loaded.append(("whole", version))


def _split_alike_worker():
    from flowrl.runtime.worker import Worker

    w = Worker(0, 2)
    place = SimpleNamespace(model="actor", group="all", generation_group="all")
    w.schedule = SimpleNamespace(ranks_of=lambda m: (0, 1), placement=lambda m: place)
    w.trainers = {"actor": _Trainer()}
    w.generators = {"actor": _Replica()}
    w.replicas = {"actor": (None, 0, 2)}
    return w


def test_a_split_alike_reshard_loads_each_ranks_own_slices():
    w = _split_alike_worker()
    stats = w.sync("actor", "reshard", 3)
    assert w.generators["actor"].loaded == [("shards", 3, {"w": (2, 4)})]
    assert stats["bytes"] == 2 * 4 * 4  # this rank's slice, not the whole model


def test_a_split_alike_reshard_never_gathers_the_whole_model():
    w = _split_alike_worker()
    w.sync("actor", "reshard", 3)
    assert w.trainers["actor"].sliced == 1
    assert w.trainers["actor"].exported == 0


# ------------------------------------------------------------ the planner's tp choices vs the engine's splits


def test_the_engine_refuses_a_tp_that_does_not_divide_the_mlp_width_naming_the_model():
    from flowrl.backends.local.tensor_parallel import check_splits
    from flowrl.errors import BackendError

    config = SimpleNamespace(num_attention_heads=2, num_key_value_heads=1, intermediate_size=129)
    with pytest.raises(BackendError, match=r"model 'actor' cannot be split tp 2: intermediate_size 129"):
        check_splits(config, 2, "actor")


def test_the_planner_offers_no_tp_the_engine_cannot_split(ray_plugin):
    try:
        _, plan = plan_for("grpo", 2, "actor.tp=2", extra=("tiny_model.intermediate_size=129",))
    except FlowRLError:
        return  # refused at planning time: correct
    pytest.fail(f"planned an unsplittable layout: {plan.layout.layout('actor').parallel}")
