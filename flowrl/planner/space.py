"""The plan space for a cluster: where models live, how each is parallelised, how rollouts flow.

A `ClusterPlan` is one point of the space. `skeletons()` enumerates placements, device-group
sizes, generation layouts, rollout policies and weight-sync strategies; `layouts()`
enumerates one model's (dp, tp, pp, micro-batch, offload) options on a group. Every
candidate already satisfies divisibility (tp divides heads and fits in a node, pp divides
layers, dp divides the batch); memory is checked by the cost model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from flowrl.specs import Spec

Placement = Literal["colocate", "split", "standalone", "disaggregated"]
RolloutMode = Literal["sync", "one_step_off", "async"]
SyncStrategy = Literal["reshard", "full", "bucketed", "sparse"]


class Parallel(Spec):
    dp: int
    tp: int
    pp: int

    @property
    def size(self) -> int:
        return self.dp * self.tp * self.pp


def samples_in_place(parallel: Parallel, generation_tp: int) -> bool:
    """Whether a model trained with ``parallel`` can sample with its training engine's own weights
    in a generation layout of ``generation_tp`` on the same group: one copy of the model, split the
    same way (tp ranks, no data-parallel shards or pipeline stages to gather): 3D-HybridEngine's
    tp = tp' case, with nothing to move."""
    return parallel.dp == 1 and parallel.pp == 1 and parallel.tp == generation_tp


class ModelLayout(Spec):
    model: str
    group: str
    parallel: Parallel  # training layout for trainable models, inference layout otherwise
    micro_batch: int  # sequences per micro-batch on each dp rank
    offload_optimizer: bool = False


class DeviceGroup(Spec):
    name: str
    devices: int
    first: int  # index of its first device in the cluster


class GenerationLayout(Spec):
    group: str
    tp: int
    replicas: int
    model: str | None = None  # the generating policy (None: the graph's first)


class RolloutPolicy(Spec):
    """How rollouts flow. ``mode`` says when generation of step k may start: ``sync`` after the
    weights of step k-1, ``one_step_off`` one version earlier (overlapping training of step k-1),
    ``async`` up to ``staleness`` versions earlier (one fewer when partial: continued responses
    need that one), picking up new weights between decode chunks.
    ``staleness`` (eta) bounds how old a trained sample's oldest token may be, in versions."""

    mode: RolloutMode = "sync"
    staleness: int = 0  # eta: generation may use weights this many versions old (0 = on-policy)
    partial: bool = False  # stop once the batch is full; unfinished responses resume next step
    overprovision: float = 0.0  # extra prompts launched when partial (APRIL)
    streaming: bool = False  # scoring nodes start on finished groups while generation goes on
    chunk_tokens: int | None = None  # partial/async/streaming: tokens decoded between checks (None: see chunk())

    def chunk(self, budget: int) -> int:
        """Tokens decoded between checks (batch full, new weights, parts to stream): the policy's,
        or a quarter of the response budget (at least 8), so a response restarts at most ~4 times."""
        return self.chunk_tokens or max(8, budget // 4)

    @property
    def lead(self) -> int:
        """How many versions ahead of training generation may start."""
        if self.mode == "sync":
            return 0
        room = max(self.staleness - self.partial, 0)  # partial keeps one version for the responses it continues
        return min(room, 1) if self.mode == "one_step_off" else room

    @property
    def chunked(self) -> bool:
        """Whether generation decodes in chunks (to check the batch, take new weights, stream)."""
        return self.partial or self.streaming or self.mode == "async"

    def describe(self) -> str:
        return (
            self.mode
            + (f" eta={self.staleness}" if self.staleness else "")
            + (f" partial+{self.overprovision:.0%}" if self.partial else "")
            + (" streaming" if self.streaming else "")
        )


class WeightSync(Spec):
    strategy: SyncStrategy
    density: float = 1.0  # fraction of weights sent (sparse delta)


class Prediction(Spec):
    iteration_s: float
    breakdown: dict[str, float]  # per graph node (+ "weight_sync"), mean seconds per iteration
    utilization: dict[str, float]  # per device group: busy fraction
    memory_bytes: dict[str, int]  # per device group: peak bytes on one device
    roofline_s: float
    efficiency: float  # roofline_s / iteration_s


class ClusterPlan(Spec):
    placement: Placement
    groups: tuple[DeviceGroup, ...]
    models: tuple[ModelLayout, ...]
    generation: GenerationLayout  # the (first) generating policy's
    rollout: RolloutPolicy
    weight_sync: WeightSync
    predicted: Prediction | None = None
    # the generation layout of every further generating policy (multi-policy graphs), by model
    generations: tuple[GenerationLayout, ...] = ()

    def layout(self, model: str) -> ModelLayout:
        return next(m for m in self.models if m.model == model)

    def generation_of(self, model: str) -> GenerationLayout:
        """The generation layout of generating model ``model``."""
        return next((g for g in self.generations if g.model == model), self.generation)

    def trains_as_it_generates(self, model: str) -> bool:
        """Whether ``model``'s training layout is its generation layout (`samples_in_place`, on the same
        group): an engine that generates with its own weights then needs no copy and no sync."""
        trained = next((m for m in self.models if m.model == model), None)
        gen = self.generation_of(model)
        return trained is not None and trained.group == gen.group and samples_in_place(trained.parallel, gen.tp)

    def group(self, name: str) -> DeviceGroup:
        return next(g for g in self.groups if g.name == name)

    def summary(self) -> str:
        parts = [f"{self.placement}"]
        for g in self.groups:
            members = [m for m in self.models if m.group == g.name]
            descr = ", ".join(
                f"{m.model}(dp{m.parallel.dp} tp{m.parallel.tp} pp{m.parallel.pp} "
                f"mb{m.micro_batch}{' off' if m.offload_optimizer else ''})"
                for m in members
            )
            gens = [("", self.generation), *((f"{x.model} ", x) for x in self.generations)]
            gen = "".join(f" gen {m}tp{x.tp}x{x.replicas}" for m, x in gens if x.group == g.name)
            parts.append(f"[{g.name}:{g.devices}] {descr}{gen}".rstrip())
        roll = self.rollout.describe()
        sync = self.weight_sync.strategy + (
            f"({self.weight_sync.density:.0%})" if self.weight_sync.strategy == "sparse" else ""
        )
        return " ".join(parts) + f" | rollout {roll} | sync {sync}"


# ------------------------------------------------------------------ enumeration


@dataclass(frozen=True)
class Roles:
    """What the graph asks of each model."""

    models: tuple[str, ...]
    actor: str  # the model that generates (the first, when several do)
    trainable: frozenset[str]
    role: tuple[tuple[str, str], ...]  # (model, role): actor, critic, reference, reward, cost
    actors: tuple[str, ...] = ()  # every model that generates (multi-policy graphs), the first is `actor`

    def role_of(self, model: str) -> str:
        return dict(self.role)[model]

    @property
    def policies(self) -> tuple[str, ...]:
        """Every generating model: ``actors``, or the actor alone when they are not listed."""
        return self.actors or (self.actor,)


@dataclass(frozen=True)
class Skeleton:
    placement: Placement
    groups: tuple[DeviceGroup, ...]
    assignment: tuple[tuple[str, str], ...]  # (model, group)
    generation: GenerationLayout
    rollout: RolloutPolicy
    weight_sync: WeightSync


def _pow2_upto(n: int) -> list[int]:
    out, k = [], 1
    while k <= n:
        out.append(k)
        k *= 2
    return out


def tp_options(heads: int, kv_heads: int, per_node: int, limit: int, intermediate: int | None = None) -> list[int]:
    """The tp sizes a model splits into (as the torch engine splits it, `tensor_parallel.check_splits`): they
    divide its heads and its MLP width, and its key/value heads (or those divide them: held whole)."""
    return [
        t
        for t in _pow2_upto(min(per_node, limit))
        if heads % t == 0
        and (kv_heads % t == 0 or t % kv_heads == 0)
        and (intermediate is None or intermediate % t == 0)
    ]


def group_sizes(total: int, per_node: int) -> list[int]:
    """Sizes a device group may take: any part of one node, beyond it any number of whole nodes
    (each model's layout then needs dp x tp x pp to fill it, with dp dividing the batch)."""
    return sorted({*range(1, min(total, per_node) + 1), *range(per_node, total + 1, per_node)})


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _groups(names_sizes: list[tuple[str, int]]) -> tuple[DeviceGroup, ...]:
    out, first = [], 0
    for name, size in names_sizes:
        out.append(DeviceGroup(name=name, devices=size, first=first))
        first += size
    return tuple(out)


def skeletons(
    roles: Roles,
    devices: int,
    per_node: int,
    heads: int,
    kv_heads: int,
    *,
    sync_density: float = 0.1,
    intermediate: int | None = None,
) -> list[Skeleton]:
    """Every placement x group split x generation layout x rollout policy x weight sync."""
    out: list[Skeleton] = []
    sizes = group_sizes(devices, per_node)
    others = [m for m in roles.models if m != roles.actor]

    def add(
        placement: Placement, groups: tuple[DeviceGroup, ...], assignment: dict[str, str], gen_group: str, overlap: bool
    ) -> None:
        g = next(x for x in groups if x.name == gen_group)
        for tp in tp_options(heads, kv_heads, per_node, g.devices, intermediate):
            gen = GenerationLayout(group=gen_group, tp=tp, replicas=g.devices // tp)
            policies = [RolloutPolicy()]
            policies.append(RolloutPolicy(staleness=1, partial=True, overprovision=0.25))
            if overlap:
                policies += [
                    RolloutPolicy(streaming=True),
                    RolloutPolicy(mode="one_step_off", staleness=1),
                    RolloutPolicy(mode="async", staleness=2, partial=True, overprovision=0.25),
                ]
            syncs = (
                [WeightSync(strategy="reshard")]
                if all(gen_group == assignment[a] for a in roles.policies)
                else [
                    WeightSync(strategy="full"),
                    WeightSync(strategy="bucketed"),
                    WeightSync(strategy="sparse", density=sync_density),
                ]
            )
            for pol in policies:
                for sync in syncs:
                    out.append(Skeleton(placement, groups, tuple(sorted(assignment.items())), gen, pol, sync))

    # verl's hybrid engine: everything on every device, generation time-shares with training
    add("colocate", _groups([("all", devices)]), {m: "all" for m in roles.models}, "all", overlap=False)
    # OpenRLHF: actor (+ reference) on one group, critic/reward on the other
    if others:
        for a in sizes:
            b = devices - a
            if b in sizes and b > 0:
                assignment = {
                    m: ("actor" if roles.role_of(m) in ("actor", "reference") else "critic") for m in roles.models
                }
                if "critic" not in assignment.values():
                    continue
                add("split", _groups([("actor", a), ("critic", b)]), assignment, "actor", overlap=False)
    # one group per model
    n = len(roles.models)
    if n > 1 and devices % n == 0 and devices // n in sizes:
        size = devices // n
        add(
            "standalone",
            _groups([(m, size) for m in roles.models]),
            {m: m for m in roles.models},
            roles.actor,
            overlap=False,
        )
    # AReaL: generation on its own devices, all training models colocated on the rest ...
    for g in sizes:
        t = devices - g
        if t in sizes and t > 0:
            add(
                "disaggregated",
                _groups([("gen", g), ("train", t)]),
                {m: "train" for m in roles.models},
                "gen",
                overlap=True,
            )
        # ... or a group per model beside the generation group (HybridFlow's standalone plus a rollout pool)
        if n > 1 and t > 0 and t % n == 0 and t // n in sizes:
            add(
                "disaggregated",
                _groups([("gen", g), *((m, t // n) for m in roles.models)]),
                {m: m for m in roles.models},
                "gen",
                overlap=True,
            )
    return out


def layouts(
    model: str,
    group: DeviceGroup,
    *,
    trainable: bool,
    per_node: int,
    heads: int,
    kv_heads: int,
    layers: int,
    batch: int,
    intermediate: int | None = None,
    split: bool = True,
) -> list[ModelLayout]:
    """One model's options on a group: dp x tp x pp = group size; micro-batches; offload. ``split`` False:
    tp 1 only (a model its engine does not split tensor-parallel)."""
    out = []
    for tp in tp_options(heads, kv_heads, per_node, group.devices, intermediate) if split else [1]:
        for pp in _divisors(group.devices // tp):
            if layers % pp:
                continue
            dp = group.devices // (tp * pp)
            if dp * tp * pp != group.devices or batch % dp:
                continue
            per_rank = batch // dp
            for mb in _pow2_upto(per_rank):  # memory (checked later) bounds it on accelerators
                if per_rank % mb:
                    continue
                for off in (False, True) if trainable else (False,):
                    out.append(
                        ModelLayout(
                            model=model,
                            group=group.name,
                            parallel=Parallel(dp=dp, tp=tp, pp=pp),
                            micro_batch=mb,
                            offload_optimizer=off,
                        )
                    )
    return out
