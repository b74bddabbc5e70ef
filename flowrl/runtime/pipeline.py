"""The steps of a schedule run as one dataflow across iterations, under the plan's rollout policy.

Each step instantiates the schedule's tasks as units. Within a step a unit waits for the tasks
it reads from; across steps:

- the training side (every task but generation) of step k runs after that of step k-1, so
  each train step sees the weights the one before it made;
- generation of step k runs after generation of step k-1 and after the weights of step
  k-1-lead are published (the sync task, or the train step when generation uses the trained
  weights in place). The policy's lead is 0 when sync, 1 one-step-off, eta async: rollouts run
  ahead of training by that many versions.

A device group runs one unit at a time; when several are ready, weight publication goes first,
then the earliest step (generation of step k counts as step k-lead). Generation decodes in
chunks when the policy needs it (partial, async, streaming): after each chunk the unit yields;
async generation then gives its groups back, so a weight sync can slip in and later chunks
sample with the new weights (interruptible generation); streaming starts the scoring nodes
(reward, forward) on each part of finished groups while generation goes on, and gathers their
outputs once generation is done.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flowrl.contract.data import GenerateResult, Part
from flowrl.errors import FlowRLError, reworded
from flowrl.graph.ir import streamed_nodes
from flowrl.runtime.compute import thread_count
from flowrl.runtime.dispatch import concat_parts, weighted_metrics
from flowrl.runtime.groups import CURRENT_TASK, publish
from flowrl.runtime.nodes import generate_metrics, run_node
from flowrl.runtime.rollout import Chunk
from flowrl.runtime.schedule import Task
from flowrl.runtime.trace import Trace

if TYPE_CHECKING:
    from flowrl.runtime.assemble import RunParts


@dataclass(eq=False)
class Unit:
    step: int
    task: Task
    name: str  # the task's name, "<node>#<part>" for a streamed part
    key: tuple[Any, ...]  # priority (lowest first)
    deps: list[tuple[int, str]]
    part: int | None = None
    gather: bool = False  # collects a streamed node's parts (on the controller)
    coro: Iterator[Chunk] | None = None
    seconds: float = 0.0

    @property
    def groups(self) -> tuple[str, ...]:
        return () if self.gather else self.task.groups


@dataclass
class StepState:
    batch: dict[str, Any]
    prompts: list[Any] | None = None  # drawn for this step when it was created (None: generation draws)
    units: int = 0
    done: int = 0
    generated: dict[str, tuple[float, GenerateResult]] = field(default_factory=dict)  # task -> (seconds, result)
    outputs: dict[str, tuple[float, dict[str, Any]]] = field(default_factory=dict)
    parts: dict[str, dict[int, Any]] = field(default_factory=dict)  # key -> part -> value (streaming)
    part_metrics: dict[str, dict[int, tuple[float, dict[str, Any]]]] = field(default_factory=dict)  # (seconds, metrics)


@dataclass
class Snapshot:
    """The pipeline at a checkpoint after step ``step``: every unit of steps up to it is done,
    nothing of a later step has started but whole generate units (rollouts run ahead), whose
    results are kept here with the later steps' prompts."""

    step: int
    next_step: int  # the first step not created yet
    version0: dict[str, int]
    steps: dict[int, dict[str, Any]]  # later step -> {"prompts": ..., "generated": {task: (seconds, result)}}


class Pipeline:
    """Runs the steps of ``schedule``; ``on_step(step, state)`` is called in step order.

    After a step k for which ``barrier(k)`` is true the pipeline drains: units of later steps
    wait, except generate units that may run ahead (of steps up to k + lead, or already begun),
    which finish. Then ``on_barrier(snapshot)`` is called (a checkpoint is written) and the run
    goes on, or stops when it returns True. ``resume`` continues from such a snapshot.
    """

    def __init__(self, parts: RunParts, trace: Trace) -> None:
        rt, schedule, policy, sources = parts.rt, parts.schedule, parts.policy, parts.sources
        self.rt, self.schedule, self.policy, self.sources = rt, schedule, policy, sources
        self.prompts, self.trace, self.transport = parts.prompts, trace, parts.transport
        graph = rt.graph
        self.order = {t.name: i for i, t in enumerate(schedule.tasks)}
        self.streamed = streamed_nodes(graph) if policy.streaming else set()
        self.training_side = [t.name for t in schedule.tasks if t.kind != "generate"]
        self.publish: dict[str, str] = {}  # model -> the task after which generation can read its new weights
        for t in schedule.tasks:
            if t.kind == "train" and t.model is not None:
                self.publish.setdefault(t.model, t.name)
            if t.kind == "sync" and t.model is not None:
                self.publish[t.model] = t.name
        in_place = {m.model for m in schedule.models if m.in_place}
        self.urgent = {
            t.name for t in schedule.tasks if t.kind == "sync" or (t.kind == "train" and t.model in in_place)
        }
        # partial rollouts choose a step's prompts while generating: readers of the inputs wait for generation
        self.after_generation = (
            {
                t.name
                for t in schedule.tasks
                if t.kind not in ("generate", "sync") and set(graph.nodes[t.name].reads) & set(graph.inputs)
            }
            if policy.partial
            else set()
        )
        self.version0 = {m: rt.trainers[m].version for m in rt.trainers}
        self.sources_of = {s.model for s in sources.values()}

    # ------------------------------------------------------------ units
    def _units(self, step: int) -> list[Unit]:
        lead = self.policy.lead
        units = []
        for t in self.schedule.tasks:
            deps = [(step, d) for d in t.deps]
            if t.kind == "generate":
                if step > 0:
                    deps.append((step - 1, t.name))
                weights = step - 1 - lead
                if t.model in self.publish and weights >= 0:
                    deps.append((weights, self.publish[t.model]))
                key: tuple[Any, ...] = (1, step - lead, self.order[t.name])
            else:
                if step > 0:
                    deps += [(step - 1, n) for n in self.training_side]
                if t.name in self.after_generation:
                    deps += [(step, g.name) for g in self.schedule.tasks if g.kind == "generate"]
                key = (0 if t.name in self.urgent else 1, step, self.order[t.name])
            units.append(Unit(step, t, t.name, key, deps, gather=t.name in self.streamed))
        return units

    def _part_unit(self, step: int, task: Task, part: int) -> Unit:
        deps = [(step - 1, n) for n in self.training_side] if step > 0 else []
        deps += [(step, f"{d}#{part}") for d in task.deps if d in self.streamed]
        return Unit(step, task, f"{task.name}#{part}", (1, step, self.order[task.name], part), deps, part=part)

    # ------------------------------------------------------------ the loop
    def run(
        self,
        steps: int,
        on_step: Callable[[int, StepState], None],
        *,
        barrier: Callable[[int], bool] = lambda step: False,
        on_barrier: Callable[[Snapshot], bool] = lambda snapshot: False,
        resume: Snapshot | None = None,
    ) -> None:
        states: dict[int, StepState] = {}
        done: set[tuple[int, str]] = set()
        pending: list[Unit] = []
        running: dict[Future, Unit] = {}
        busy: set[str] = set()
        next_step, finished = 0, 0
        draining: int | None = None  # the step of the checkpoint the pipeline drains for
        window = self.policy.lead + 2  # steps in flight: generation runs ahead by the lead
        # task threads route work to the engines (which compute on the compute thread: flowrl.runtime.compute)
        pool = ThreadPoolExecutor(
            max_workers=len(self.schedule.groups) + 4,
            thread_name_prefix="flowrl-task",
            initializer=thread_count,
            initargs=(1,),
        )

        def submit(unit: Unit) -> None:
            view = self._view(unit, states[unit.step])
            running[pool.submit(contextvars.copy_context().run, self._work, unit, view)] = unit

        def create(step: int, prompts: list[Any] | None) -> None:
            state = StepState(batch={} if prompts is None else {"prompts": prompts}, prompts=prompts)
            units = self._units(step)
            state.units = len(units)
            states[step] = state
            pending.extend(units)

        def may_run(unit: Unit) -> bool:
            if draining is None or unit.step <= draining:
                return True
            return unit.task.kind == "generate" and (unit.step <= draining + self.policy.lead or unit.coro is not None)

        restored = -1  # the steps before a resumed run's first (done in the run it continues)
        if resume is not None:
            restored = resume.step
            next_step, finished = resume.next_step, resume.step + 1
            self.version0 = dict(resume.version0)
            for step in sorted(resume.steps):
                create(step, resume.steps[step]["prompts"])
            for step in sorted(resume.steps):
                for name, (seconds, value) in resume.steps[step]["generated"].items():
                    unit = next(u for u in pending if u.step == step and u.name == name)
                    pending.remove(unit)
                    unit.seconds = seconds
                    self._finish(unit, states[step], value, pending)
                    done.add((step, name))
                    states[step].done += 1

        try:
            while finished < steps or draining is not None:
                while draining is None and next_step < steps and next_step < finished + window:
                    create(next_step, self.prompts(next_step))
                    next_step += 1
                pending.sort(key=lambda u: u.key)
                for unit in list(pending):
                    ready = all(d[0] <= restored or d in done for d in unit.deps)
                    if ready and not busy.intersection(unit.groups) and may_run(unit):
                        pending.remove(unit)
                        busy.update(unit.groups)
                        self.transport.iteration = unit.step
                        submit(unit)
                if not running and draining is not None:  # drained: every unit that may run has run
                    later = {
                        step: {"prompts": st.prompts, "generated": dict(st.generated)}
                        for step, st in states.items()
                        if step > draining
                    }
                    stop = on_barrier(Snapshot(draining, next_step, dict(self.version0), later))
                    draining = None
                    if stop:
                        return
                    continue
                if not running:  # pragma: no cover - the dependencies form no cycle
                    raise RuntimeError(f"the pipeline stalled with {len(pending)} units waiting")
                finished_futures, _ = wait(list(running), return_when=FIRST_COMPLETED)
                for fut in finished_futures:
                    unit = running.pop(fut)
                    state = states[unit.step]
                    kind, value, start, end = fut.result()  # raises the unit's error
                    unit.seconds += end - start
                    if not unit.gather:
                        self.trace.add(unit.task.name, unit.task.groups or ("controller",), start, end, unit.step)
                    if kind == "chunk":
                        self._add_parts(unit, state, value.parts, pending)
                        if self.policy.mode == "async":  # interruptible: give the groups back between chunks
                            busy.difference_update(unit.groups)
                            pending.append(unit)
                        else:
                            submit(unit)
                        continue
                    busy.difference_update(unit.groups)
                    self._finish(unit, state, value, pending)
                    done.add((unit.step, unit.name))
                    if unit.part is None:
                        state.done += 1
                while draining is None and finished < next_step and states[finished].done == states[finished].units:
                    on_step(finished, states.pop(finished))
                    finished += 1
                    if barrier(finished - 1):
                        draining = finished - 1
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------ one unit
    def _view(self, unit: Unit, state: StepState) -> dict[str, Any]:
        if unit.task.kind == "sync" or unit.gather:
            return {}
        reads = self.rt.graph.nodes[unit.task.name].reads
        if unit.part is not None:
            return {k: state.parts[k][unit.part] if k in state.parts else state.batch[k] for k in reads}
        return {k: state.batch[k] for k in reads if k in state.batch}

    def _work(self, unit: Unit, view: dict[str, Any]) -> tuple[str, Any, float, float]:
        try:
            return self._run_unit(unit, view)
        except FlowRLError as exc:  # say which step, after the first line (which names the node)
            first, nl, rest = str(exc).partition("\n")
            raise reworded(exc, f"{first.rstrip('.')} (step {unit.step}).{nl}{rest}") from exc.__cause__

    def _run_unit(self, unit: Unit, view: dict[str, Any]) -> tuple[str, Any, float, float]:
        CURRENT_TASK.set(unit.task.name)
        start = time.time()
        if unit.task.kind == "generate":
            if unit.coro is None:
                source = self.sources[unit.task.name]
                version = self.version0.get(source.model, 0) + unit.step
                prompts = view.get(self.rt.graph.nodes[unit.task.name].reads[0])
                unit.coro = source.run(unit.step, version, prompts, self.rt.rng(unit.task.name))
            try:
                chunk = next(unit.coro)
            except StopIteration as stop:
                return "done", stop.value, start, time.time()
            return "chunk", chunk, start, time.time()
        if unit.gather:
            return "done", None, start, time.time()
        if unit.task.kind == "sync":
            model = unit.task.model or ""
            stats = publish(self.rt.trainers[model], self.rt.generators[model], unit.task.strategy, unit.task.name)
            return "done", ({}, stats), start, time.time()
        return "done", run_node(self.rt, unit.task.name, view), start, time.time()

    def _add_parts(self, unit: Unit, state: StepState, parts: list[Part], pending: list[Unit]) -> None:
        """Streamed parts of a step's responses: keep them and start the scoring nodes on them."""
        if not self.streamed:
            return
        node = self.rt.graph.nodes[unit.task.name]
        for part in parts:
            j = len(state.parts.get(node.writes[0], {}))
            for key, value in zip(node.writes, (part.sequences, part.sequences.logprobs)):
                state.parts.setdefault(key, {})[j] = value
            if self.policy.partial:  # the batch's prompts grow with its parts (prompt_index numbers them)
                state.batch.setdefault(node.reads[0], []).extend(part.prompts)
            for t in self.schedule.tasks:
                if t.name in self.streamed:
                    sub = self._part_unit(unit.step, t, j)
                    pending.append(sub)
                    gather = next(u for u in pending if u.gather and u.step == unit.step and u.name == t.name)
                    gather.deps.append((unit.step, sub.name))

    def _finish(self, unit: Unit, state: StepState, value: Any, pending: list[Unit]) -> None:
        task = unit.task
        if task.kind == "generate":
            result: GenerateResult = value
            state.generated[task.name] = (unit.seconds, result)
            state.batch.update(result.outputs)  # dynamic sampling: what the nodes up to the filter wrote
            state.outputs.update(result.nodes)  # ... and their (seconds, metrics)
            node = self.rt.graph.nodes[task.name]
            self._add_parts(unit, state, result.parts[len(state.parts.get(node.writes[0], {})) :], pending)
            if result.prompts is not None:
                state.batch[node.reads[0]] = result.prompts
            seqs = result.sequences
            state.batch.update(zip(node.writes, (seqs, seqs.logprobs)))
            state.outputs[task.name] = (
                unit.seconds,
                {**generate_metrics(state.batch[node.reads[0]], seqs), **result.metrics},
            )
        elif unit.part is not None:
            out, metrics = value
            for key, v in out.items():
                state.parts.setdefault(key, {})[unit.part] = v
            state.part_metrics.setdefault(task.name, {})[unit.part] = (unit.seconds, metrics)
        elif unit.gather:
            self._gather(task, state)
        else:
            out, metrics = value
            state.batch.update(out)
            state.outputs[task.name] = (unit.seconds, metrics)
            if (
                task.kind == "train"
                and self.publish.get(task.model or "") == task.name
                and task.model in self.sources_of
            ):
                # generation samples with these weights in place: they are the next version
                publish(self.rt.trainers[task.model], self.rt.generators[task.model], None, task.name)

    def _gather(self, task: Task, state: StepState) -> None:
        """A streamed node's outputs: its parts' values concatenated in part order; numeric metrics
        averaged over parts weighted by their rows; seconds summed."""
        node = self.rt.graph.nodes[task.name]
        first = node.writes[0]
        order = sorted(state.parts[first])
        for key in node.writes:
            state.batch[key] = concat_parts([state.parts[key][j] for j in order])
        sizes = [len(state.parts[first][j]) for j in order]
        runs = state.part_metrics.get(task.name, {})
        seconds = sum(runs[j][0] for j in order)
        metrics = weighted_metrics([(n, runs[j][1]) for j, n in zip(order, sizes)])
        metrics["parts"] = len(order)
        state.outputs[task.name] = (seconds, metrics)
