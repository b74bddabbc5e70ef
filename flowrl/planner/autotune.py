"""The auto-tuner: search the plan space within a time budget, simulate, explain the winner.

1. Enumerate skeletons (placement, group sizes, generation layout, rollout policy, weight
   sync) from `space.skeletons`.
2. For each skeleton choose every model's layout: its Pareto-optimal options (time vs
   memory), then greedily trade time for memory until every group fits. Small spaces are
   enumerated exhaustively instead.
3. Simulate each fitting candidate (cheap settings), then re-simulate the best few with
   more iterations and all replicas. Deterministic for a seed.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from flowrl.contract.capabilities import Capabilities, rollout_conflict, supports, supports_layout
from flowrl.contract.checked import gib
from flowrl.contract.hardware import ClusterSpec
from flowrl.contract.layout import ClusterPlan, ModelLayout, Prediction, RolloutPolicy, samples_in_place
from flowrl.contract.model import ModelSpec
from flowrl.contract.workload import WorkloadSpec, mean_length, sample_lengths
from flowrl.errors import PlanError
from flowrl.graph.ir import Forward, Graph, Train
from flowrl.planner import memory as mem
from flowrl.planner import pipeline as pipe
from flowrl.planner.constraints import Constraints
from flowrl.planner.cost import CostModel
from flowrl.planner.hardware import cost_provenance
from flowrl.planner.sample_efficiency import Objective, features
from flowrl.planner.simulate import MicroBatching, SimResult, simulate
from flowrl.planner.space import Roles, Skeleton, layouts, skeletons

RAW_FACTOR = 25  # exhaustive search checks at most this many combinations per fitting plan it may keep
QUICK = {"iterations": 3, "max_replicas": 8}  # first pass over every candidate
FINAL = {"iterations": 5, "max_replicas": 32}  # the ranking that is reported


@dataclass
class Candidate:
    plan: ClusterPlan
    result: SimResult
    memory: dict[str, int]


@dataclass
class Infeasible:
    skeleton: Skeleton
    group: str
    need: int
    breakdown: dict[str, int]


@dataclass
class TuneResult:
    ranked: list[Candidate]
    considered: int
    infeasible: list[Infeasible] = field(default_factory=list)
    seconds: float = 0.0
    roofline: dict[str, float] = field(default_factory=dict)
    pipelines: list[str] = field(default_factory=list)  # the winner's pipeline terms (`Tuner.pipelines`)
    objective: Objective = field(default_factory=Objective)  # what the ranking is by
    samples: int = 0  # trained samples per iteration (samples per second = samples / iteration_s)
    offline: bool = False  # a train-only graph: no generation, rollout policy or weight sync to explain

    @property
    def best(self) -> ClusterPlan:
        return self.ranked[0].plan


def _pair_loss(registry: Any, loss: str) -> bool:
    """Whether loss ``loss`` reads rows in pairs (registered with ``rows="pairs"``: preference pairs)."""
    return loss in registry.names("losses") and registry.entry("losses", loss).meta.get("rows", "each") == "pairs"


def _captured(registry: Any, engine: str) -> bool:
    """Whether generation engine ``engine`` decodes from captured graphs (its declared capabilities)."""
    if registry is None or engine not in registry.names("generation_engines"):
        return False
    caps = registry.entry("generation_engines", engine).meta.get("capabilities")
    return bool(getattr(caps, "captured_decode", False))


def roles_of(graph: Graph) -> Roles:
    gens = [n for n in graph.nodes.values() if n.kind == "generate"]
    if not gens:  # a train-only graph (its responses come from the data): the train stage alone is planned
        trainable = [m for m, d in graph.models.items() if d.trainable]
        if not trainable:
            raise PlanError(f"graph '{graph.name}' neither generates nor trains: there is nothing to plan.")
        return Roles(
            models=tuple(graph.models),
            actor=trainable[0],
            trainable=frozenset(trainable),
            role=tuple((m, d.role) for m, d in graph.models.items()),
            offline=True,
        )
    return Roles(
        models=tuple(graph.models),
        actor=gens[0].model,
        actors=tuple(dict.fromkeys(n.model for n in gens if n.model is not None)),
        trainable=frozenset(m for m, d in graph.models.items() if d.trainable),
        role=tuple((m, d.role) for m, d in graph.models.items()),
    )


def _generation_devices(sk: Skeleton) -> int:
    """The size of the device group a skeleton generates on."""
    return next(g.devices for g in sk.groups if g.name == sk.generation.group)


def _pinned(
    sks: list[Skeleton], placement: str | None, weight_sync: str | None, rollout: RolloutPolicy | None = None
) -> list[Skeleton]:
    """The skeletons with the pinned placement and sync strategy (a PlanError naming what exists if
    none), and with the pinned rollout policy in place of the space's."""
    if rollout is not None:
        sks = list({dataclasses.replace(sk, rollout=rollout): None for sk in sks})
    for what, value, of in (
        ("placement", placement, lambda sk: sk.placement),
        ("weight sync", weight_sync, lambda sk: sk.weight_sync.strategy),
    ):
        if value is None:
            continue
        kept = [sk for sk in sks if of(sk) == value]
        if not kept:
            have = ", ".join(sorted({of(sk) for sk in sks})) or "none"
            raise PlanError(f"no plan for this graph on this cluster has {what} '{value}'; there are: {have}.")
        sks = kept
    return sks


class Tuner:
    def __init__(
        self,
        graph: Graph,
        model: ModelSpec,
        cluster: ClusterSpec,
        workload: WorkloadSpec,
        *,
        seed: int = 0,
        cost_model: str = "analytic",
        registry: Any = None,
        numerics: mem.Numerics | None = None,
        capabilities: Capabilities | None = None,
        generation_engine: str | None = None,
        training_engine: str | None = None,
        rows: dict[str, int] | None = None,
        constraints: Constraints | None = None,
        models: Mapping[str, ModelSpec] | None = None,
        micro_batch: int | None = None,
        unsplit: Collection[str] = (),
        train_steps: Mapping[str, tuple[int, int]] | None = None,
        fused: Collection[str] = (),
        batching: MicroBatching | None = None,
        objective: Objective | None = None,
    ) -> None:
        """``model``: every graph model's shape, unless ``models`` names one for it (per-role models).
        ``train_steps``: train nodes' own (epochs, mini-batches), as the plan resolved them; ``fused``:
        forward nodes their train node computes (``ExecutionPlan.fused``), which cost nothing of their own;
        ``batching``: how forward and train passes cut micro-batches (``train.max_tokens_per_micro_batch``,
        ``train.pack``): a layout's micro-batch is then a cap on rows, its passes costed at the budget's (and every
        row at the workload's ``padded_to``, where its trainer pads rows);
        ``objective``: what candidates are ranked by (default: seconds per iteration)."""
        self.graph, self.model, self.cluster, self.w, self.seed = graph, model, cluster, workload, seed
        self.objective = objective or Objective()
        self.rows = rows  # per node, when it differs from the workload's sequences (multi-policy, filters)
        self.train_steps = train_steps
        self.fused = frozenset(fused)
        self.micro_batch = micro_batch  # configured (train.micro_batch_size): every layout uses it
        self.batching = dataclasses.replace(batching or MicroBatching(), pad_to=workload.padded_to)
        self.unsplit = frozenset(unsplit)  # models whose engine does not split them tensor-parallel (LoRA)
        # models trained by a loss reading rows in pairs (preference pairs), which pipeline stages would cut
        self.unstaged = frozenset(
            n.model
            for n in graph.nodes.values()
            if isinstance(n, Train) and registry is not None and _pair_loss(registry, n.loss)
        )
        self.constraints = constraints or Constraints()  # what the user requires (--require)
        self.numerics = numerics or mem.Numerics()
        if self.numerics.activation_bytes >= 4:  # an engine computing in float32 runs at the fp32 peak
            hw = msgspec.structs.replace(cluster.hardware, peak_flops_bf16=cluster.hardware.peak_flops_fp32)
            cluster = self.cluster = msgspec.structs.replace(cluster, hardware=hw)
        # the training engine generates with the weights it trains: no second copy where it trains
        self.in_place = self.numerics.generation_in_place and generation_engine == training_engine
        self.capacity = mem.usable_bytes(cluster.hardware, self.numerics)
        self.capabilities = capabilities
        factory = registry.get("cost_models", cost_model) if registry is not None else CostModel
        # each model as it computes: a critic, reward or cost model with its scalar head, not the LM head
        self.specs = {m: (models or {}).get(m, model).with_head(d.scalar_head) for m, d in graph.models.items()}
        by_shape = {}  # one cost model per distinct shape
        for spec in (model, *self.specs.values()):
            if spec not in by_shape:
                cost = factory(spec, cluster.hardware)
                if generation_engine is not None and hasattr(cost, "for_engine"):  # cost models may ignore engines
                    cost = cost.for_engine(generation_engine, captured=_captured(registry, generation_engine))
                by_shape[spec] = cost
        self.costs = {m: by_shape[spec] for m, spec in self.specs.items()}
        self.roles = roles_of(graph)
        self.cost = self.costs.get(self.roles.actor, by_shape[model])  # generation's
        for cost in by_shape.values():  # fit the efficiency curves now, not on the search's clock
            getattr(cost, "curve", None)
        self.seq_len = workload.prompt_length + int(mean_length(workload.response_length))
        # a batch of response lengths: forward and train passes pay for their micro-batches' padding
        self.lengths = sample_lengths(workload.response_length, workload.sequences, np.random.default_rng(seed))
        self.max_len = workload.prompt_length + workload.max_response()
        self.row_len = workload.longest_trained_row()
        self.forwards = {
            m: sum(1 for n in graph.nodes.values() if isinstance(n, Forward) and n.model == m and n.name not in fused)
            for m in graph.models
        }
        # per model, the others that may still be gathered from a forward while its nodes run (sharded on its
        # devices, they are held there too: `memory.gathered_while`)
        self.gathered_while: dict[str, set[str]] = {m: set() for m in graph.models}
        for n in graph.nodes.values():
            if isinstance(n, (Forward, Train)) and n.model is not None and n.name not in self.fused:
                self.gathered_while[n.model].update(mem.gathered_while(graph, n.name, self.fused))
        self._layout_cache: dict[tuple[str, int], list[tuple[ModelLayout, float, int, int]]] = {}
        self._scores: dict[ModelLayout, tuple[ModelLayout, float, int, int]] = {}

    # ------------------------------------------------------------ per model
    def options(self, model: str, group) -> list[tuple[ModelLayout, float, int, int]]:
        """(layout, seconds per iteration, static bytes, activation bytes), Pareto-pruned."""
        key = (model, group.devices)
        if key not in self._layout_cache:
            trainable = model in self.roles.trainable
            batch = self.w.sequences // self.w.mini_batches
            options = layouts(
                model,
                group,
                trainable=trainable,
                per_node=self.cluster.devices_per_node,
                heads=self.specs[model].heads,
                kv_heads=self.specs[model].kv_heads,
                layers=self.specs[model].layers,
                batch=batch,
                intermediate=self.specs[model].intermediate,
                split=model not in self.unsplit,
            )
            if self.capabilities is not None:
                options = [lay for lay in options if supports_layout(self.capabilities, lay)]
            if model in self.unstaged:  # its loss reads whole pairs: no pipeline stages (the engine refuses them)
                options = [lay for lay in options if lay.parallel.pp == 1]
            options = [lay for lay in options if self.constraints.fits_layout(model, lay)]
            if self.micro_batch is not None:  # the configured micro-batch, within each rank's share of the batch
                options = list(
                    dict.fromkeys(
                        msgspec.structs.replace(lay, micro_batch=min(self.micro_batch, batch // lay.parallel.dp))
                        for lay in options
                    )
                )
                spec = self.specs[model]  # a pipeline schedule that needs more micro-batches than that gives can't run
                options = [
                    lay
                    for lay in options
                    if pipe.layout_problem(lay, spec, batch // lay.parallel.dp // lay.micro_batch) is None
                ]
            scored = [self.score(lay) for lay in options]
            scored.sort(key=lambda x: (x[1], x[2] + x[3]))
            front: list[tuple[ModelLayout, float, int, int]] = []
            # Pareto front over (time, static bytes, activation bytes); the actor's tp x pp also
            # sets the reshard time into the generation layout, so each gets its own front
            for item in scored:
                same = (
                    (lambda f: True)
                    if model != self.roles.actor
                    else (lambda f, p=item[0].parallel: f[0].parallel.tp * f[0].parallel.pp == p.tp * p.pp)
                )
                if not any(same(f) and f[1] <= item[1] and f[2] <= item[2] and f[3] <= item[3] for f in front):
                    front.append(item)
            self._layout_cache[key] = front
        return [(msgspec.structs.replace(lay, group=group.name), *rest) for lay, *rest in self._layout_cache[key]]

    def _schedule_problem(self, models: list[str]) -> str | None:
        """Why a required pipeline schedule (``MODEL.schedule`` / ``MODEL.virtual_stages``) of one of ``models``
        fits no pipeline size of this cluster (`pipeline.schedule_problem`, its decoder layers named), or None."""
        for model in models:
            need = self.constraints.pipeline.get(model)
            if not need:
                continue
            layers = self.specs[model].layers
            sizes = self.constraints.parallel.get(model, {}).get("pp")
            pps = [sizes] if sizes else list(range(2, self.cluster.devices + 1))
            schedule = str(need.get("schedule", "interleaved" if int(need.get("virtual_stages", 1)) > 1 else "1f1b"))
            vs = [int(need["virtual_stages"])] if "virtual_stages" in need else (
                list(pipe.VIRTUAL_STAGES) if schedule == "interleaved" else [1]
            )  # fmt: skip
            problems = [pipe.schedule_problem(schedule, pp, v, pp, layers) for pp in pps for v in vs]
            if problems and all(problems):
                return (
                    f"model '{model}' ({layers} decoder layers) cannot run --require "
                    f"{' '.join(f'{model}.{k}={v}' for k, v in need.items())} over pp {', '.join(map(str, pps))}: "
                    f"{problems[0]}. Require a schedule its layers allow (gpipe or 1f1b: pp dividing the layers; "
                    "interleaved: pp x virtual_stages dividing them), or a model with more layers."
                )
        return None

    def score(self, lay: ModelLayout) -> tuple[ModelLayout, float, int, int]:
        """(layout, seconds per iteration of its forward and train nodes, static bytes, activation bytes)."""
        key = msgspec.structs.replace(lay, group="")  # the group's name changes nothing
        if key not in self._scores:
            self._scores[key] = self._score(key)
        return (lay, *self._scores[key][1:])

    def _score(self, lay: ModelLayout) -> tuple[ModelLayout, float, int, int]:
        trainable = lay.model in self.roles.trainable
        rows, seq = self.batching.cut(self.lengths, self.w.prompt_length, lay.micro_batch, lay.parallel.dp)
        costed = msgspec.structs.replace(lay, micro_batch=rows)  # the micro-batches a token budget cuts
        cost, spec = self.costs[lay.model], self.specs[lay.model]
        seconds = self.forwards[lay.model] * cost.forward(
            costed, self.w.sequences, seq, backward=False, sharded=trainable
        )
        if trainable:
            seconds += self.w.ppo_epochs * (
                cost.forward(
                    costed, self.w.sequences, seq, backward=True, sharded=trainable, mini_batches=self.w.mini_batches
                )
                + self.w.mini_batches * cost.optimizer_step(lay)
            )
        states = mem.state_bytes(spec, self.numerics, lay, trainable)
        # the largest micro-batch it holds: the layout's rows at the longest sequence, or what the budget holds
        held = msgspec.structs.replace(lay, micro_batch=self.batching.memory_rows(lay.micro_batch, self.row_len))
        steps = mem.micro_steps(
            self.w.sequences,
            held,
            held.micro_batch,
            self._fewest_mini_batches(lay.model),
            self.batching.max_tokens is None,
        )
        return (
            lay,
            seconds,
            states,
            mem.model_pass_bytes(spec, self.numerics, held, self.row_len, trainable, steps),
        )

    def _fewest_mini_batches(self, model: str) -> int:
        """The fewest mini-batches a train node of ``model`` takes a step (its own, or the workload's): the
        largest mini-batch, whose micro-steps set the gradients a sharded model accumulates."""
        own = self.train_steps or {}
        trains = [n.name for n in self.graph.nodes.values() if isinstance(n, Train) and n.model == model]
        return min((own.get(n, (0, self.w.mini_batches))[1] for n in trains), default=self.w.mini_batches)

    def group_memory(
        self, sk: Skeleton, choice: dict[str, tuple[ModelLayout, float, int, int]], group: str
    ) -> tuple[int, dict[str, int]]:
        members = [m for m, g in sk.assignment if g == group]
        peaks = {}
        for m in members:
            lay = choice[m][0]
            left = {
                y: mem.left_gathered_bytes(self.specs[y], self.numerics, choice[y][0])
                for y in sorted(self.gathered_while[m])
                if y in members
            }
            left = {y: b for y, b in left.items() if b}
            sharded = mem.sharded(self.numerics, lay, m in self.roles.trainable)
            name = f"{m} activations" + (" + gathered weights and gradients" if sharded else "")
            name += f" + {' and '.join(left)} left gathered" if left else ""
            peaks[name] = choice[m][3] + sum(left.values())
        if sk.generation.group == group:  # the policies generate in turn: each engine is a peak of its own
            for actor in self.roles.policies:
                # in place: the training engine samples, on one device (sharded, a full replica per rank)
                in_place = (
                    self.in_place and actor in members and samples_in_place(choice[actor][0].parallel, sk.generation.tp)
                )
                gen = mem.generation_bytes(
                    self.specs[actor], self.numerics, sk.generation, self.w.sequences, self.max_len, in_place
                )
                name = "generation weights + KV cache" + ("" if actor == self.roles.actor else f" ({actor})")
                peaks[name] = gen
        return mem.group_need({f"{m} states": choice[m][2] for m in members}, peaks)

    def fit(self, sk: Skeleton) -> dict[str, tuple[ModelLayout, float, int, int]] | Infeasible:
        """Greedy: fastest layouts, then trade the least time per byte until each group fits."""
        groups = {g.name: g for g in sk.groups}
        opts = {m: self.options(m, groups[g]) for m, g in sk.assignment}
        for m, o in opts.items():
            if not o:
                return Infeasible(sk, dict(sk.assignment)[m], 0, {f"{m}: no layout divides the group and batch": 0})
        idx = {m: 0 for m in opts}
        cap = self.capacity
        while True:
            choice = {m: opts[m][i] for m, i in idx.items()}
            worst = None
            for g in groups:
                need, breakdown = self.group_memory(sk, choice, g)
                if need > cap and (worst is None or need - cap > worst[1] - cap):
                    worst = (g, need, breakdown)
            if worst is None:
                return choice
            g, need, breakdown = worst
            moves = []
            for m, gm in sk.assignment:
                if gm != g:
                    continue
                cur = opts[m][idx[m]]
                for j in range(idx[m] + 1, len(opts[m])):  # any slower option that needs less memory
                    nxt = opts[m][j]
                    saved = (cur[2] + cur[3]) - (nxt[2] + nxt[3])
                    if saved > 0:
                        moves.append(((nxt[1] - cur[1]) / saved, m, j))
            if not moves:
                return Infeasible(sk, g, need, breakdown)
            _, m, j = min(moves)
            idx[m] = j

    # ------------------------------------------------------------ plans
    def plan_of(self, sk: Skeleton, choice: dict[str, tuple[ModelLayout, float, int, int]]) -> ClusterPlan:
        return ClusterPlan(
            placement=sk.placement,
            groups=sk.groups,
            models=tuple(choice[m][0] for m in self.roles.models),
            generation=sk.generation,
            rollout=sk.rollout,
            weight_sync=sk.weight_sync,
            # further policies share the generation group, each with its own layout
            generations=tuple(msgspec.structs.replace(sk.generation, model=m) for m in self.roles.actors[1:]),
        )

    def evaluate(self, plan: ClusterPlan, *, iterations: int, max_replicas: int | None) -> Candidate:
        gen_group = plan.generation.group
        members = [m for m in plan.models if m.group == gen_group]
        static = sum(
            mem.state_bytes(self.specs[m.model], self.numerics, m, m.model in self.roles.trainable) for m in members
        )
        result = simulate(
            self.graph,
            plan,
            self.costs,
            self.w,
            self.roles,
            static_gen_bytes=static,
            iterations=iterations,
            seed=self.seed,
            sampled_replicas=max_replicas,
            numerics=self.numerics,
            node_rows=self.rows,
            train_steps=self.train_steps,
            fused=self.fused,
            in_place=[m for m in self.roles.actors if self.in_place and plan.trains_as_it_generates(m)],
            batching=self.batching,
        )
        memory = {}
        choice = {m.model: self.score(m) for m in plan.models}
        sk = Skeleton(
            plan.placement,
            plan.groups,
            tuple((m.model, m.group) for m in plan.models),
            plan.generation,
            plan.rollout,
            plan.weight_sync,
        )
        for g in plan.groups:
            memory[g.name] = self.group_memory(sk, choice, g.name)[0]
        return Candidate(plan=plan, result=result, memory=memory)

    # ------------------------------------------------------------ search
    def search(
        self,
        *,
        budget_s: float = 8.0,
        exhaustive_limit: int = 4000,
        keep: int = 8,
        placement: str | None = None,
        weight_sync: str | None = None,
        rollout: RolloutPolicy | None = None,
        chunk_tokens: int | None = None,
    ) -> TuneResult:
        """The ranked plans of the cluster; ``placement`` / ``weight_sync`` / ``rollout`` pin those
        choices; ``chunk_tokens`` sets the decode chunk of chunked rollout policies."""
        t0 = time.perf_counter()
        sks = skeletons(
            self.roles,
            self.cluster.devices,
            self.cluster.devices_per_node,
            self.specs[self.roles.actor].heads,
            self.specs[self.roles.actor].kv_heads,
            intermediate=self.specs[self.roles.actor].intermediate,
        )
        policies = [self.specs[a] for a in self.roles.policies]
        # each policy's own heads and MLP width
        sks = [
            sk
            for sk in sks
            if all(p.heads % sk.generation.tp == 0 == p.intermediate % sk.generation.tp for p in policies)
        ]
        c = self.constraints
        if self.roles.offline and (c.generation_tp is not None or c.generation_devices is not None):
            key = "generation.tp" if c.generation_tp is not None else "generation.devices"
            raise PlanError(f"--require {key}: this graph generates nothing (no node samples), so it has no {key}.")
        sks = _pinned(sks, placement or c.placement, weight_sync or c.weight_sync, rollout)
        if c.generation_tp is not None:
            have = sorted({sk.generation.tp for sk in sks})
            sks = [sk for sk in sks if sk.generation.tp == c.generation_tp]
            if not sks:
                heads = {a: self.specs[a].heads for a in self.roles.policies}
                odd = [f"the {h} heads of '{a}'" for a, h in heads.items() if h % c.generation_tp]
                why = f": tp {c.generation_tp} does not divide {', '.join(odd)}" if odd else ""
                raise PlanError(
                    f"no plan for this graph on this cluster has generation tp {c.generation_tp} (required){why}; "
                    f"there are: {', '.join(map(str, have))}."
                )
        if c.generation_devices is not None:
            have = sorted({_generation_devices(sk) for sk in sks})
            sks = [sk for sk in sks if _generation_devices(sk) == c.generation_devices]
            if not sks:
                raise PlanError(
                    f"no plan for this graph on this cluster generates on a group of {c.generation_devices} device(s) "
                    f"(required: generation.devices); the groups generation may run on: {', '.join(map(str, have))}."
                )
        conflict = rollout_conflict(self.graph, rollout) if rollout is not None else None
        if conflict:
            raise PlanError(conflict)
        sks = [sk for sk in sks if rollout_conflict(self.graph, sk.rollout) is None]
        if chunk_tokens is not None:
            sks = list(
                {
                    dataclasses.replace(
                        sk, rollout=msgspec.structs.replace(sk.rollout, chunk_tokens=chunk_tokens)
                    ): None
                    for sk in sks
                }
            )
        caps = self.capabilities
        if caps is not None:
            if caps.max_devices is not None and self.cluster.devices > caps.max_devices:
                raise PlanError(
                    f"the executor runs at most {caps.max_devices} device(s); this cluster has "
                    f"{self.cluster.devices}. Plan without --executor for a forecast, or pick an executor that "
                    "runs it."
                )
            sks = [sk for sk in sks if supports(caps, sk.placement, sk.rollout, sk.weight_sync, sk.generation.tp)]
        candidates: list[ClusterPlan] = []
        infeasible: list[Infeasible] = []
        combos = self._combinations(sks, exhaustive_limit) or None  # none fit: the fit loop says why
        if combos is not None:
            candidates = combos
        else:
            for sk in sks:
                fit = self.fit(sk)
                if isinstance(fit, Infeasible):
                    infeasible.append(fit)
                else:
                    candidates.append(self.plan_of(sk, fit))
        if not candidates:
            raise PlanError(self._nothing_fits(infeasible))
        candidates = self._promising_first(candidates)
        quick: list[Candidate] = []
        if combos is not None:  # small space: every candidate with the final settings, so the optimum is exact
            for plan in candidates:  # ... unless the budget runs out first
                if quick and time.perf_counter() - t0 > budget_s:
                    break
                quick.append(self.evaluate(plan, **FINAL))
        else:
            for plan in candidates:
                if quick and time.perf_counter() - t0 > budget_s * 0.7:
                    break
                quick.append(self.evaluate(plan, **QUICK))
        quick.sort(key=self.rank)
        finals = quick[:keep] if combos is not None else [self.evaluate(c.plan, **FINAL) for c in quick[:keep]]
        finals.sort(key=self.rank)
        ranked = [self._sealed(c) for c in finals] + quick[keep:]
        result = TuneResult(
            ranked=ranked,
            considered=len(quick),
            infeasible=infeasible,
            seconds=time.perf_counter() - t0,
            objective=self.objective,
            samples=self.w.sequences,
            offline=self.roles.offline,
        )
        result.roofline = self.roofline(ranked[0])
        ranked[0] = self._sealed(ranked[0], result.roofline)
        result.pipelines = self.pipelines(ranked[0].plan)
        return result

    def pipelines(self, plan: ClusterPlan) -> list[str]:
        """What each model split into pipeline stages pays for it, one line each: its micro-batches per step,
        the bubble, each stage's time per micro-batch against the mean (the first holds the embedding, the last
        the LM head and the loss), the micro-batches in flight on each stage, and the stage crossings."""
        lines = []
        for lay in plan.models:
            p = lay.parallel
            if p.pp == 1:
                continue
            trainable = lay.model in self.roles.trainable
            rows, seq = self.batching.cut(self.lengths, self.w.prompt_length, lay.micro_batch, p.dp)
            minis = self.w.mini_batches if trainable else 1
            pc = self.costs[lay.model].pipeline(
                msgspec.structs.replace(lay, micro_batch=rows),
                self.w.sequences,
                seq,
                backward=trainable,
                sharded=trainable,
                mini_batches=minis,
            )
            per = pc.per_rank
            mean = sum(per) / len(per)
            flight = [pipe.in_flight(lay.schedule, p.pp, lay.virtual_stages, pc.micro_batches, r) for r in range(p.pp)]
            crossings = p.pp * lay.virtual_stages - 1
            kind = "train step" if trainable else "forward"
            lines.append(
                f"  pipeline {lay.model} pp{p.pp}{lay.describe_schedule()} ({kind}): "
                f"{pc.micro_batches} micro-batches x {pc.steps} step(s); bubble {pc.bubble:.0%} of a step; stage "
                f"time per micro-batch {' : '.join(f'{u / mean:.2f}' for u in per)} of the mean (first: embedding, "
                f"last: LM head + loss); in flight "
                + (" / ".join(f"{x:g}" for x in flight) if trainable else "1")
                + f" micro-batches per stage; {crossings} stage crossing(s) per micro-batch"
                f" ({sum(pc.p2p) / max(sum(per), 1e-30):.0%} of stage time)"
            )
        return lines

    def _promising_first(self, candidates: list[ClusterPlan]) -> list[ClusterPlan]:
        """The order to simulate in, so that a budget that runs out has seen the promising plans first:
        by a rough estimate of the step. Deterministic: it depends on the plans alone."""

        mean = mean_length(self.w.response_length)

        def estimate(plan: ClusterPlan) -> float:
            """Training of the busiest group, plus (sync) or beside (overlapped) a rough decode: each replica's
            tokens in steps of up to 256 live sequences."""
            per_group: dict[str, float] = {}
            for lay in plan.models:
                per_group[lay.group] = per_group.get(lay.group, 0.0) + self.score(lay)[1]
            train = max(per_group.values(), default=0.0)
            gen = plan.generation
            live = max(1.0, min(256.0, self.w.sequences / gen.replicas))
            steps = self.w.sequences * mean * (1 + plan.rollout.overprovision) / gen.replicas / live
            context = np.array([self.w.prompt_length + mean / 2])
            decode = steps * float(self.cost.decode_step(np.array([live]), context, gen.tp)[0])
            return train + decode if plan.rollout.lead == 0 else max(train, decode)

        return sorted(candidates, key=lambda p: (self.objective.score(p, estimate(p)), p.summary()))

    def rank(self, c: Candidate) -> tuple[float, str]:
        """The sort key of the ranking: the objective (seconds per iteration, or predicted seconds to the
        target), then the plan's summary (deterministic ties)."""
        return self.objective.score(c.plan, c.result.iteration_s), c.plan.summary()

    def single(self, plan: ClusterPlan) -> TuneResult:
        """The prediction of the one plan a cluster allows (one device), ranked alone."""
        t0 = time.perf_counter()
        candidate = self.evaluate(plan, **FINAL)
        result = TuneResult(
            ranked=[candidate],
            considered=1,
            objective=self.objective,
            samples=self.w.sequences,
            offline=self.roles.offline,
        )
        result.roofline = self.roofline(candidate)
        result.ranked[0] = self._sealed(candidate, result.roofline)
        result.pipelines = self.pipelines(plan)
        result.seconds = time.perf_counter() - t0
        return result

    def _combinations(self, sks: list[Skeleton], limit: int) -> list[ClusterPlan] | None:
        """All fitting layout combinations, when there are at most ``limit`` of them (and at most
        ``RAW_FACTOR * limit`` combinations to check for fit)."""
        total, per_sk = 0, []
        for sk in sks:
            groups = {g.name: g for g in sk.groups}
            opts = [list(self.options(m, groups[g])) for m, g in sk.assignment]
            total += math.prod(len(o) for o in opts)
            if total > RAW_FACTOR * limit:
                return None
            per_sk.append((sk, opts))
        out = []
        for sk, opts in per_sk:
            for combo in itertools.product(*opts):
                choice = {m: c for (m, _), c in zip(sk.assignment, combo)}
                if all(self.group_memory(sk, choice, g.name)[0] <= self.capacity for g in sk.groups):
                    out.append(self.plan_of(sk, choice))
                    if len(out) > limit:
                        return None
        return out

    def _sealed(self, c: Candidate, roofline: dict[str, float] | None = None) -> Candidate:
        roof = roofline or self.roofline(c)
        pred = Prediction(
            iteration_s=round(c.result.iteration_s, 6),
            breakdown={k: round(v, 6) for k, v in c.result.breakdown.items()},
            utilization=c.result.utilization,
            memory_bytes=c.memory,
            roofline_s=round(roof["bound_s"], 6),
            efficiency=round(roof["bound_s"] / c.result.iteration_s, 4) if c.result.iteration_s else 0.0,
        )
        return Candidate(plan=msgspec.structs.replace(c.plan, predicted=pred), result=c.result, memory=c.memory)

    def roofline(self, c: Candidate) -> dict[str, float]:
        """Lower bounds: all FLOPs at cluster peak; every decode step streams the weights once."""
        hw, n = self.cluster.hardware, self.cluster.devices
        compute = c.result.flops / (n * hw.peak_flops_bf16)
        decode = c.result.longest_decode * self.cost.param_bytes / (n * hw.memory_bandwidth)
        return {
            "peak_flops": hw.peak_flops_bf16,  # of the precision the engine computes in
            "flops": c.result.flops,
            "compute_bound_s": compute,
            "decode_bound_s": decode,
            "bound_s": max(compute, decode),
        }

    def describe_models(self) -> str:
        """``llama-7b (6.7B parameters)``, or per model when the roles differ."""
        shapes = {spec.name: spec.with_head(False) for spec in self.specs.values()}  # the models given
        if len(shapes) <= 1:
            spec = next(iter(shapes.values()), self.model)
            return f"{spec.name} ({spec.parameters() / 1e9:.1f}B parameters)"
        return shapes_line(self.specs)

    def _nothing_fits(self, infeasible: list[Infeasible]) -> str:
        hw = self.cluster.hardware
        if self.capacity <= 0:
            return (
                f"no plan fits: a {hw.name} device has {hw.memory_bytes:,} bytes of memory, none of it usable after "
                f"what the runtime reserves ({gib(hw.memory_bytes - self.capacity)}); is the cluster's "
                "'memory_bytes' in bytes?"
            )
        sized = [i for i in infeasible if i.need > 0]  # the others: no layout divides their group and batch
        if infeasible and not sized:
            models = sorted({key.split(":")[0] for i in infeasible for key in i.breakdown})
            required = self.constraints.describe()
            caps = self.capabilities
            wants = {k for d in self.constraints.parallel.values() for k in ("tp", "pp") if d.get(k, 1) > 1}
            lacks = [
                (k, flag)
                for k, flag in (("tp", "model_parallel"), ("pp", "pipeline_parallel"))
                if k in wants and caps is not None and not getattr(caps, flag)
            ]
            if lacks:
                kind, flag = lacks[0]
                what = "tensor" if kind == "tp" else "pipeline"
                return (
                    f"no plan fits {self.graph.name}: --require {required} splits a model over devices ({kind} > 1), "
                    f"but the run's training engine declares no {what} parallelism (see `flowrl plugins`), or its "
                    f"executor cannot place it. Use an engine that declares EngineCapabilities({flag}=True), or drop "
                    f"the {kind} requirement."
                )
            lora = sorted(m for m in self.unsplit if self.constraints.parallel.get(m, {}).get("tp", 1) > 1)
            if lora:
                return (
                    f"no plan fits {self.graph.name}: --require {required} splits model '{lora[0]}' tensor-parallel, "
                    "but it trains LoRA adapters, which the torch engine does not split. Drop the tp requirement, or "
                    "train it without LoRA (train.lora.rank=0)."
                )
            paired = sorted(m for m in self.unstaged if self.constraints.parallel.get(m, {}).get("pp", 1) > 1)
            if paired:
                return (
                    f"no plan fits {self.graph.name}: --require {required} splits model '{paired[0]}' into pipeline "
                    "stages, but its loss reads rows in pairs (chosen, rejected), which stages would cut apart. "
                    "Drop the pp requirement."
                )
            staged = self._schedule_problem(models)
            if staged is not None:
                return f"no plan fits {self.graph.name} on {self.cluster.devices} x {hw.name}: {staged}"
            return (
                f"no plan fits {self.graph.name} on {self.cluster.devices} x {hw.name}: no parallel layout of "
                f"{', '.join(models)}{f' with --require {required}' if required else ''} fills a device group of "
                f"this cluster (tp must divide the model's heads and MLP width, pp its layers, and dp the mini-batch "
                f"of {self.w.sequences // self.w.mini_batches} sequences). "
                + ("Relax the requirement, or use" if required else "Use")
                + " a cluster or a mini-batch whose sizes divide."
            )
        lean = min(sized, key=lambda i: i.need - self.capacity) if sized else None
        where = ""
        if lean is not None:
            parts = ", ".join(f"{k} {gib(v)}" for k, v in sorted(lean.breakdown.items(), key=lambda kv: -kv[1]))
            where = (
                f" The leanest candidate ({lean.skeleton.placement}) needs {gib(lean.need)} per device on "
                f"group '{lean.group}' "
                f"but each {hw.name} offers {gib(self.capacity)} usable, short by "
                f"{gib(lean.need - self.capacity)} ({parts})."
            )
        n = self.numerics
        per_trainable = n.weight_bytes + n.grad_bytes + n.optimizer_bytes
        states = sum(
            (per_trainable if m in self.roles.trainable else n.weight_bytes) * self.specs[m].parameters()
            for m in self.roles.models
        )
        need_devices = -(-states // self.capacity)
        suggestion = self.cluster.devices_per_node
        while suggestion < need_devices:
            suggestion *= 2
        if suggestion > self.cluster.devices:
            advice = f"try --cluster {suggestion}x{hw.name} or a smaller --model."
        else:  # the states would fit: activations or the KV cache do not
            limits = (
                ""
                if self.capabilities is None or self.capabilities.model_parallel or self.capabilities.pipeline_parallel
                else " (this executor splits no model over devices)"
            )
            advice = (
                f"the states fit here, so activations or the KV cache do not{limits}: use shorter "
                "prompts/responses, fewer sequences per step, or a larger cluster."
            )
        return (
            f"no plan fits {self.graph.name} with {self.describe_models()} ({len(self.roles.models)} models) "
            f"on {self.cluster.devices} x {hw.name}.{where} The model states alone need {gib(states)} "
            f"({per_trainable} bytes/parameter per trainable model, {n.weight_bytes} per frozen one), so at "
            f"least {need_devices} of these devices without optimizer offload; "
            f"{advice}"
        )


def shapes_line(specs: Mapping[str, ModelSpec]) -> str:
    """``actor=llama-34b (33.7B), rm=llama-7b (6.7B)``: each graph model's shape."""
    return ", ".join(f"{m}={s.name} ({s.parameters() / 1e9:.1f}B)" for m, s in specs.items())


def explain(
    result: TuneResult,
    model: ModelSpec,
    cluster: ClusterSpec,
    top: int = 5,
    models: Mapping[str, ModelSpec] | None = None,
) -> str:
    """The winner, its per-node times, memory and roofline, and why each runner-up loses.
    ``models``: per-role model shapes (shown when given)."""
    best = result.ranked[0]
    pred = best.plan.predicted
    label = _label(result)
    lines = [
        f"searched {result.considered} feasible plans in {result.seconds:.2f}s ({len(result.infeasible)} "
        "skeletons rejected for memory)",
        cost_provenance(cluster.hardware),
    ]
    if models:
        lines.append("models: " + shapes_line(models))
    lines += [
        f"winner: {pred.iteration_s:.2f} s/iteration  {label(best.plan)}",
        "  per node (mean seconds per iteration):",
    ]
    for k, v in sorted(pred.breakdown.items(), key=lambda kv: -kv[1]):
        lines.append(f"    {k:<18} {v:9.3f}")
    lines.append(
        "  device groups: "
        + ", ".join(
            f"{g}: {u:.0%} busy, {gib(pred.memory_bytes.get(g, 0))}/device" for g, u in pred.utilization.items()
        )
    )
    lines += result.pipelines
    roof = result.roofline
    lines.append(
        f"  roofline: {roof['flops'] / 1e15:.1f} PFLOP/iteration -> {roof['compute_bound_s']:.2f}s at "
        f"{cluster.devices} x {roof.get('peak_flops', cluster.hardware.peak_flops_bf16) / 1e12:.3g} TFLOP/s; "
        + ("" if result.offline else f"decode bound {roof['decode_bound_s']:.2f}s; ")
        + f"the plan reaches {pred.efficiency:.0%} of the bound"
    )
    lines += objective_lines(result, top)
    lines.append("runners-up:")
    seen = {best.plan.summary()}
    shown = 0
    for c in result.ranked[1:]:
        if c.plan.summary() in seen or shown >= top:
            continue
        seen.add(c.plan.summary())
        shown += 1
        change = _change(c.result.iteration_s / pred.iteration_s - 1)
        lines.append(f"  {c.result.iteration_s:8.2f}s ({change})  {label(c.plan)}")
        lines.append(f"           loses on: {why_slower(c, best, result.objective)}")
    return "\n".join(lines)


def _label(result: TuneResult) -> Callable[[ClusterPlan], str]:
    """How the explanation names a plan: its summary, without generation, rollout and sync for a train-only graph."""
    return lambda plan: plan.summary(generates=not result.offline)


def _change(x: float) -> str:
    """``+12%``, ``-3%``; a change that rounds to nothing is ``+0%``."""
    return f"{x:+.0%}" if abs(x) >= 0.005 else "+0%"


def duration(seconds: float) -> str:
    """``42.0 s``, ``12.5 min``, ``3.2 h``, ``1.5 d``: a time to target, readable."""
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.1f} s"


def distinct(ranked: list[Candidate], top: int, shapes: bool = False) -> list[Candidate]:
    """The first ``top`` candidates of distinct plans (a plan simulated twice is shown once); ``shapes``:
    of distinct shapes (`ClusterPlan.shape`: the best of each, whatever its micro-batch and offload)."""
    seen: set[str] = set()
    out = []
    for c in ranked:
        key = c.plan.shape() if shapes else c.plan.summary()
        if key not in seen and len(out) < top:
            seen.add(key)
            out.append(c)
    return out


def objective_lines(result: TuneResult, top: int = 5) -> list[str]:
    """What the ranking is by, the top candidates' samples per second and predicted time to the target
    reward side by side, and one line on why the winner wins."""
    obj = result.objective
    if result.offline:  # nothing generates: no rollout policy to trade samples' freshness against speed
        label = _label(result)
        lines = [f"objective: {obj.kind} (seconds per iteration, i.e. samples per second; a train-only graph)"]
        lines.append(f"  {'s/iteration':>11} {'samples/s':>10}  plan")
        for c in distinct(result.ranked, top + 1):
            it = c.result.iteration_s
            lines.append(f"  {it:11.3f} {result.samples / it if it > 0 else 0.0:10.1f}  {label(c.plan)}")
        best = result.ranked[0].result.iteration_s
        lines.append(
            f"why: it is the fastest per iteration ({result.samples / best if best > 0 else 0.0:.1f} samples/s)."
        )
        return lines
    how = {
        "throughput": "seconds per iteration, i.e. samples per second; --objective time-to-target ranks by "
        "predicted time to the target reward",
        "time-to-target": "predicted time to the target reward = seconds per iteration x iterations to the target",
    }[obj.kind]
    lines = [
        f"objective: {obj.kind} ({how})",
        f"  target: {obj.target_steps} iterations of a sync run (--target-steps; default the run's steps); "
        f"sample efficiency {obj.efficiency.describe()}",
        f"  {'s/iteration':>11} {'samples/s':>10} {'steps':>8} {'to target':>10}  plan",
    ]
    shown = distinct(result.ranked, top + 1)
    other = min(  # the winner under the other objective, shown too
        result.ranked,
        key=lambda c: (
            c.result.iteration_s if obj.kind != "throughput" else obj.time_to_target(c.plan, c.result.iteration_s),
            c.plan.summary(),
        ),
    )
    if all(c.plan.summary() != other.plan.summary() for c in shown):
        shown.append(other)
    for c in shown:
        it = c.result.iteration_s
        sps = result.samples / it if it > 0 else 0.0
        lines.append(
            f"  {it:11.3f} {sps:10.1f} {obj.steps(c.plan.rollout):8.0f} "
            f"{duration(obj.time_to_target(c.plan, it)):>10}  {c.plan.summary()}"
        )
    lines.append("why: " + why_wins(result))
    return lines


def _staleness(policy: Any) -> str:
    """``samples 1.1 versions stale, 100% off-policy, 10% recycled`` (what costs a policy iterations)."""
    stale, off, share = features(policy)
    if not (stale or off or share):
        return "on-policy samples"
    parts = [f"samples {stale:.2g} version{'' if stale == 1 else 's'} stale", f"{off:.0%} off-policy"]
    if share:
        parts.append(f"{share:.0%} of tokens recycled")
    return ", ".join(parts)


def why_wins(result: TuneResult) -> str:
    """One line: why the winner wins under the objective, against the plan the other objective would pick."""
    obj, ranked = result.objective, result.ranked
    best = ranked[0]
    if len({c.plan.summary() for c in ranked}) == 1:
        return "it is the only plan searched."

    def ttt(c: Candidate) -> float:
        return obj.time_to_target(c.plan, c.result.iteration_s)

    def sps(c: Candidate) -> float:
        return result.samples / c.result.iteration_s if c.result.iteration_s > 0 else 0.0

    fastest = min(ranked, key=lambda c: (c.result.iteration_s, c.plan.summary()))
    soonest = min(ranked, key=lambda c: (ttt(c), c.plan.summary()))
    if obj.kind == "time-to-target":
        if fastest.plan.summary() == best.plan.summary():
            steps, why = obj.steps(best.plan.rollout), _staleness(best.plan.rollout)
            return (
                f"it is the fastest per iteration ({sps(best):.1f} samples/s) and so, at {steps:.0f} iterations to "
                f"the target ({why}), the soonest there ({duration(ttt(best))})."
            )
        return (
            f"it reaches the target in {duration(ttt(best))} against {duration(ttt(fastest))} for the fastest per "
            f"iteration (rollout {fastest.plan.rollout.describe()}, {sps(fastest):.1f} samples/s against "
            f"{sps(best):.1f}): that plan's {_staleness(fastest.plan.rollout)} need "
            f"{obj.steps(fastest.plan.rollout):.0f} iterations to the winner's {obj.steps(best.plan.rollout):.0f} "
            f"({_staleness(best.plan.rollout)}; {obj.efficiency.source} sample efficiency)."
        )
    if soonest.plan.summary() == best.plan.summary():
        return (
            f"it is the fastest per iteration ({sps(best):.1f} samples/s) and, with {_staleness(best.plan.rollout)}, "
            f"also the soonest to the target ({duration(ttt(best))})."
        )
    return (
        f"it is the fastest per iteration ({sps(best):.1f} samples/s), but its {_staleness(best.plan.rollout)} "
        f"need {obj.steps(best.plan.rollout):.0f} iterations to the target: rollout "
        f"{soonest.plan.rollout.describe()} ({sps(soonest):.1f} samples/s, {obj.steps(soonest.plan.rollout):.0f} "
        f"iterations) would get there sooner ({duration(ttt(soonest))} against {duration(ttt(best))}); "
        "rank by that with --objective time-to-target."
    )


def why_slower(c: Candidate, best: Candidate, objective: Objective | None = None) -> str:
    """What costs the runner-up against the winner: under time-to-target, the iterations its rollout policy
    needs when it is no slower per iteration; else the components that cost it the most time."""
    if objective is not None and objective.kind == "time-to-target":
        steps_c, steps_b = objective.steps(c.plan.rollout), objective.steps(best.plan.rollout)
        if steps_c > steps_b and c.result.iteration_s <= best.result.iteration_s:
            faster = 1 - c.result.iteration_s / best.result.iteration_s if best.result.iteration_s else 0.0
            return (
                f"{steps_c:.0f} iterations to the target against {steps_b:.0f} ({_staleness(c.plan.rollout)}), "
                f"though {faster:.0%} faster per iteration"
            )
    return _slower_components(c, best)


def _slower_components(c: Candidate, best: Candidate) -> str:
    """The components that cost the runner-up the most time against the winner."""
    deltas = {
        k: c.result.breakdown.get(k, 0.0) - best.result.breakdown.get(k, 0.0)
        for k in set(c.result.breakdown) | set(best.result.breakdown)
    }
    busy_c = sum(c.result.breakdown.values())
    busy_b = sum(best.result.breakdown.values())
    overlap = (busy_c - c.result.iteration_s) - (busy_b - best.result.iteration_s)
    reasons = [(v, f"{k} +{v:.2f}s") for k, v in deltas.items() if v > 0.01 * best.result.iteration_s]
    if overlap < -0.01 * best.result.iteration_s:
        reasons.append((-overlap, f"less overlap/idle bubbles +{-overlap:.2f}s"))
    reasons.sort(reverse=True)
    return ", ".join(r for _, r in reasons[:3]) or "within noise of the winner"
