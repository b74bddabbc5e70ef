"""Lowering: graph + plan -> the schedule the executor runs, the same for every backend.

One iteration is a list of tasks. Each task runs a graph node (or a weight sync) on the
device groups the plan gives it (none: the controller), after the tasks it depends on; a
group runs one task at a time and different groups run at once, as the planner's simulator
assumed. A weight-sync task follows the train node of each model that generates whenever
generation does not use the trained weights in place; it carries the plan's strategy. A
forward node the plan fuses into its train node (``plan.fused``) has no task: the train task
computes its output.

Nothing here re-plans: groups, ranks, micro-batches and the sync strategy all come from
the plan.
"""

from __future__ import annotations

from flowrl.contract.plan import ExecutionPlan
from flowrl.errors import PlanError
from flowrl.graph.ir import Compute, Forward, Generate, Graph, Reward, Source, Train
from flowrl.specs import Spec


class Task(Spec):
    name: str  # a graph node, or "sync:<train node>"
    kind: str  # generate | source | forward | reward | compute | train | sync
    groups: tuple[str, ...]  # device groups it occupies; () runs on the controller
    deps: tuple[str, ...]  # tasks of the same iteration that must finish first
    model: str | None = None
    micro_batch: int = 0
    strategy: str | None = None  # sync tasks: reshard | full | bucketed | sparse
    # generate tasks whose rows a filter keeps: the nodes between them and the filter, then the
    # filter, run inside the task in every dynamic-sampling round
    absorbs: tuple[str, ...] = ()


class GroupRanks(Spec):
    """A device group as worker ranks (global ranks ``first .. first + size - 1``)."""

    name: str
    first: int
    size: int

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(range(self.first, self.first + self.size))


class ModelPlacement(Spec):
    """Where one model's training engine lives and how generation reaches its weights."""

    model: str
    group: str
    dp: int
    generation_group: str | None = None  # the group that generates with it (None: it does not generate)
    in_place: bool = False  # generation samples with the training engine itself


class Schedule(Spec):
    world: int  # ranks (devices) the plan uses
    groups: tuple[GroupRanks, ...]
    models: tuple[ModelPlacement, ...]
    tasks: tuple[Task, ...]  # one iteration, in a topological order

    def group(self, name: str) -> GroupRanks:
        return next(g for g in self.groups if g.name == name)

    def placement(self, model: str) -> ModelPlacement:
        return next(m for m in self.models if m.model == model)

    def ranks_of(self, model: str) -> tuple[int, ...]:
        return self.group(self.placement(model).group).ranks

    def generation_ranks(self, model: str) -> tuple[int, ...]:
        g = self.placement(model).generation_group
        return () if g is None else self.group(g).ranks


def lower(graph: Graph, plan: ExecutionPlan, *, same_engine: bool = True) -> Schedule:
    """The schedule of ``plan`` for ``graph``. ``same_engine``: the generation engine is the
    training engine (config ``generation.engine == train.engine``), so a model generated on its
    own one-rank group samples with its trained weights in place."""
    layout = plan.layout
    if layout is None:
        raise PlanError("the plan has no placement (layout); make it with `flowrl plan`.")
    groups = tuple(GroupRanks(name=g.name, first=g.first, size=g.devices) for g in layout.groups)
    world = sum(g.devices for g in layout.groups)
    generating = {n.model for n in graph.nodes.values() if isinstance(n, Generate)}
    models = []
    for name in graph.models:
        ml = layout.layout(name)
        gen = name in generating
        gen_group = layout.generation_of(name).group
        in_place = gen and same_engine and layout.trains_as_it_generates(name)
        models.append(
            ModelPlacement(
                model=name,
                group=ml.group,
                dp=ml.parallel.dp,
                generation_group=gen_group if gen else None,
                in_place=in_place,
            )
        )
    by_model = {m.model: m for m in models}
    dag = graph.dag()
    micro = {n.node: n.micro_batch_size for n in plan.nodes}
    absorbed = {gen: (*graph.filter_segment(f)[1], f) for gen, f in graph.filters().items()}
    inside = {n: gen for gen, names in absorbed.items() for n in names}
    tasks: list[Task] = []
    after: dict[str, tuple[str, ...]] = {}  # a task's dependencies; a fused forward's are its own's
    for name in graph.order():
        node = graph.nodes[name]
        if name in inside:
            continue
        deps = tuple(dict.fromkeys(d for p in dag.predecessors(name) for d in after.get(p, (inside.get(p, p),))))
        if name in plan.fused:  # its train node computes its output: no task of its own
            after[name] = deps
            continue
        if isinstance(node, Generate):
            task = Task(
                name=name,
                kind="generate",
                groups=(layout.generation_of(node.model).group,),
                deps=deps,
                model=node.model,
                absorbs=absorbed.get(name, ()),
            )
        elif isinstance(
            node, (Forward, Train)
        ):  # groups.TrainingGroup: scoring cuts rows per rank, a train step goes to every rank
            task = Task(
                name=name,
                kind=node.kind,
                groups=(by_model[node.model].group,),
                deps=deps,
                model=node.model,
                micro_batch=micro.get(name, 0),
            )
        elif isinstance(node, (Source, Reward, Compute)):
            task = Task(name=name, kind=node.kind, groups=(), deps=deps)
        else:  # pragma: no cover - the IR is a closed set
            raise TypeError(node)
        tasks.append(task)
        if isinstance(node, Train) and node.model in generating and not by_model[node.model].in_place:
            place = by_model[node.model]
            gen_group = layout.generation_of(node.model).group
            if layout.weight_sync.strategy == "reshard" and place.group != gen_group:
                raise PlanError(
                    f"weight sync 'reshard' moves weights within one device group, but model '{node.model}' trains on "
                    f"'{place.group}' and generates on '{gen_group}'; plan a full, bucketed or sparse sync."
                )
            sync = Task(
                name=f"sync:{name}",
                kind="sync",
                groups=tuple(dict.fromkeys((place.group, gen_group))),
                deps=(name,),
                model=node.model,
                strategy=layout.weight_sync.strategy,
            )
            tasks.append(sync)
    return Schedule(world=world, groups=groups, models=tuple(models), tasks=tuple(tasks))
