"""Where a plan puts models, how each is parallelised, how rollouts flow: one `ClusterPlan`
(the planner enumerates the space of them: `flowrl.planner.space`)."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from flowrl.specs import MAX_STALENESS, Spec

Placement = Literal["colocate", "split", "standalone", "disaggregated"]
RolloutMode = Literal["sync", "one_step_off", "async"]
SyncStrategy = Literal["reshard", "full", "bucketed", "sparse"]
#: how a model split into pipeline stages (pp > 1) runs its micro-batches: GPipe (every forward, then
#: every backward: all micro-batches' activations in flight), 1F1B (at most pp in flight, the same
#: bubble) or interleaved 1F1B (``virtual_stages`` stages per rank: the bubble shrinks by that factor)
PipelineSchedule = Literal["gpipe", "1f1b", "interleaved"]

#: what a plan file may say (checked when a plan is read): sizes of at least one and at most the
#: devices the planner models, so an edited plan is refused naming its field, never run (a staleness
#: of 10^9 looped over its histogram, a negative device index was a KeyError)
MAX_DEVICES = 1 << 20
Size = Annotated[int, Meta(ge=1, le=MAX_DEVICES)]
Index = Annotated[int, Meta(ge=0, lt=MAX_DEVICES)]


class Parallel(Spec):
    dp: Size
    tp: Size
    pp: Size

    @property
    def size(self) -> int:
        return self.dp * self.tp * self.pp


def samples_in_place(parallel: Parallel, generation_tp: int) -> bool:
    """Whether a model trained with ``parallel`` can sample with its training engine's own weights
    in a generation layout of ``generation_tp`` on the same group: one copy of the model, split the
    same way (tp ranks, no data-parallel shards or pipeline stages to gather): 3D-HybridEngine's
    tp = tp' case, with nothing to move."""
    return parallel.dp == 1 and parallel.pp == 1 and parallel.tp == generation_tp


def tp_inside_nodes(first: int, devices: int, tp: int, per_node: int) -> bool:
    """Whether every row of ``tp`` consecutive devices of the group ``first .. first + devices - 1`` (one
    model copy's tensor-parallel ranks) lies on one node of ``per_node`` devices: tp runs inside a node."""
    return all(
        start // per_node == (min(start + tp, first + devices) - 1) // per_node
        for start in range(first, first + devices, tp)
    )


class ModelLayout(Spec):
    model: str
    group: str
    parallel: Parallel  # training layout for trainable models, inference layout otherwise
    micro_batch: Annotated[int, Meta(ge=1)]  # sequences per micro-batch on each dp rank
    offload_optimizer: bool = False
    # with pp > 1: the pipeline schedule, and stages per rank (above 1 only for "interleaved")
    schedule: PipelineSchedule = "1f1b"
    virtual_stages: Annotated[int, Meta(ge=1, le=64)] = 1

    def describe_schedule(self) -> str:
        """`` 1f1b``, `` gpipe`` or `` int2`` (interleaved, 2 stages per rank) for a layout split into pipeline
        stages; empty for pp = 1."""
        if self.parallel.pp == 1:
            return ""
        return f" int{self.virtual_stages}" if self.schedule == "interleaved" else f" {self.schedule}"


class DeviceGroup(Spec):
    name: str
    devices: Size
    first: Index  # index of its first device in the cluster


class GenerationLayout(Spec):
    group: str
    tp: Size
    replicas: Size
    model: str | None = None  # the generating policy (None: the graph's first)


class RolloutPolicy(Spec):
    """How rollouts flow. ``mode`` says when generation of step k may start: ``sync`` after the
    weights of step k-1, ``one_step_off`` one version earlier (overlapping training of step k-1),
    ``async`` up to ``staleness`` versions earlier (one fewer when partial: continued responses
    need that one), picking up new weights between decode chunks.
    ``staleness`` (eta) bounds how old a trained sample's oldest token may be, in versions."""

    mode: RolloutMode = "sync"
    # eta: generation may use weights this many versions old (0 = on-policy)
    staleness: Annotated[int, Meta(ge=0, le=MAX_STALENESS)] = 0
    partial: bool = False  # stop once the batch is full; unfinished responses resume next step
    overprovision: Annotated[float, Meta(ge=0, le=16)] = 0.0  # extra prompts launched when partial (APRIL)
    streaming: bool = False  # scoring nodes start on finished groups while generation goes on
    # partial/async/streaming: tokens decoded between checks (None: see chunk())
    chunk_tokens: Annotated[int, Meta(ge=1)] | None = None

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
    density: Annotated[float, Meta(ge=0, le=1)] = 1.0  # fraction of weights sent (sparse delta)


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

    def summary(self, generates: bool = True, knobs: bool = True) -> str:
        """One line: placement, groups and their models' layouts, then the generation layout, rollout policy
        and weight sync; ``generates=False`` (a train-only graph): without those three, which it has none of;
        ``knobs=False``: without each model's micro-batch size and optimizer offload (`shape`)."""
        parts = [f"{self.placement}"]
        for g in self.groups:
            members = [m for m in self.models if m.group == g.name]
            descr = ", ".join(
                f"{m.model}(dp{m.parallel.dp} tp{m.parallel.tp} pp{m.parallel.pp}{m.describe_schedule()}"
                + (f" mb{m.micro_batch}{' off' if m.offload_optimizer else ''}" if knobs else "")
                + ")"
                for m in members
            )
            gens = [("", self.generation), *((f"{x.model} ", x) for x in self.generations)]
            gen = "".join(f" gen {m}tp{x.tp}x{x.replicas}" for m, x in gens if x.group == g.name) if generates else ""
            parts.append(f"[{g.name}:{g.devices}] {descr}{gen}".rstrip())
        if not generates:
            return " ".join(parts)
        roll = self.rollout.describe()
        sync = self.weight_sync.strategy + (
            f"({self.weight_sync.density:.0%})" if self.weight_sync.strategy == "sparse" else ""
        )
        return " ".join(parts) + f" | rollout {roll} | sync {sync}"

    def shape(self) -> str:
        """The plan's shape: placement, groups, parallelism, generation layout, rollout policy and weight sync,
        without the knobs that tune a model's layout in place (micro-batch size, optimizer offload)."""
        return self.summary(knobs=False)
