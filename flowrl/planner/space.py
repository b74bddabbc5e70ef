"""The plan space for a cluster: where models live, how each is parallelised, how rollouts flow.

A `ClusterPlan` is one point of the space. `skeletons()` enumerates placements, device-group
sizes, generation layouts, rollout policies and weight-sync strategies; `layouts()`
enumerates one model's (dp, tp, pp, micro-batch, offload) options on a group, and with pp > 1
its pipeline schedules (GPipe, 1F1B, interleaved 1F1B with v stages per rank: `schedules()`).
Every candidate already satisfies divisibility (tp divides heads and fits in a node, pp divides
layers, pp x v divides them interleaved, dp divides the batch) and the schedule's rules on its
micro-batches; memory is checked by the cost model.
"""

from __future__ import annotations

from dataclasses import dataclass

from flowrl.contract.layout import (
    DeviceGroup,
    GenerationLayout,
    ModelLayout,
    Parallel,
    PipelineSchedule,
    Placement,
    RolloutPolicy,
    WeightSync,
    tp_inside_nodes,
)
from flowrl.planner import pipeline as pipe

# ------------------------------------------------------------------ enumeration


@dataclass(frozen=True)
class Roles:
    """What the graph asks of each model."""

    models: tuple[str, ...]
    actor: str  # the model that generates (the first, when several do)
    trainable: frozenset[str]
    role: tuple[tuple[str, str], ...]  # (model, role): actor, critic, reference, reward, cost
    actors: tuple[str, ...] = ()  # every model that generates (multi-policy graphs), the first is `actor`
    # no model generates (a train-only graph: its responses come from the data); `actor` is then the
    # first trainable model, and no generation layout is costed
    offline: bool = False

    def role_of(self, model: str) -> str:
        return dict(self.role)[model]

    @property
    def policies(self) -> tuple[str, ...]:
        """Every generating model: ``actors``, or the actor alone when they are not listed (none offline)."""
        if self.offline:
            return ()
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
    """The tp sizes a model splits into (as the torch engine splits it, `parallelize.tensor.check_splits`): they
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
            if g.devices % tp or not tp_inside_nodes(g.first, g.devices, tp, per_node):
                continue  # replicas that leave devices idle, or a group across a node boundary
            gen = GenerationLayout(group=gen_group, tp=tp, replicas=g.devices // tp)
            if roles.offline:  # nothing generates: no rollout policy or weight sync to choose
                out.append(Skeleton(placement, groups, tuple(sorted(assignment.items())), gen, RolloutPolicy(),
                                    WeightSync(strategy="reshard")))  # fmt: skip
                break
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
    if roles.offline:  # no generation group to give devices to
        return out
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
        if not tp_inside_nodes(group.first, group.devices, tp, per_node):  # a group across a node boundary
            continue
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
                for schedule, virtual in schedules(pp, layers, per_rank // mb):
                    for off in (False, True) if trainable else (False,):
                        out.append(
                            ModelLayout(
                                model=model,
                                group=group.name,
                                parallel=Parallel(dp=dp, tp=tp, pp=pp),
                                micro_batch=mb,
                                offload_optimizer=off,
                                schedule=schedule,
                                virtual_stages=virtual,
                            )
                        )
    return out


def schedules(pp: int, layers: int, micro_batches: int) -> list[tuple[PipelineSchedule, int]]:
    """The (schedule, virtual stages per rank) a model of ``layers`` layers split into ``pp`` stages may run with
    ``micro_batches`` micro-batches per step: GPipe, 1F1B and interleaved 1F1B with each of
    `pipeline.VIRTUAL_STAGES` that divides the layers (torch's rules: `pipeline.schedule_problem`); one
    stage (the default, 1F1B with v = 1) for pp = 1."""
    if pp == 1:
        return [("1f1b", 1)]
    options: list[tuple[PipelineSchedule, int]] = [("gpipe", 1), ("1f1b", 1)]
    options += [("interleaved", v) for v in pipe.VIRTUAL_STAGES]
    return [(s, v) for s, v in options if pipe.schedule_problem(s, pp, v, micro_batches, layers) is None]
