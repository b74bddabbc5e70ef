"""The executor: runs the schedule lowered from a plan on worker groups, the same for every backend.

`PlanExecutor.run` lowers the plan once (`flowrl.runtime.schedule.lower`), starts the workers
(`launch`: here one `Worker` in this process; the Ray backend one actor per device), wraps each
model in a `TrainingGroup` / `GenerationGroup`, and then per step draws prompts from the task
and runs the iteration's tasks as a dataflow: a task starts when its dependencies are done and
its device groups are free. It logs one metrics line per step (what the nodes report, a span
per task), writes a checkpoint per trainable model, a reward-curve PNG, and the run's trace
(trace.json, timeline.png). Nothing re-plans at run time.

A backend subclasses it with its capabilities; `check` refuses a plan it cannot run before any
model is built.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from flowrl.errors import ConfigError, PlanError, plain_name
from flowrl.graph.ir import Generate, Graph, Train
from flowrl.planner.capabilities import Capabilities, rollout_conflict, unsupported
from flowrl.planner.passes import node_options, verify_plan
from flowrl.planner.plan import ExecutionPlan, dump_plan
from flowrl.planner.space import RolloutPolicy
from flowrl.runtime.protocols import RunResult
from flowrl.runtime.trace import Trace
from flowrl.runtime.worker import Worker
from flowrl.tasks.builtin import make_task

# The modules that import torch load when a plan runs, not with this module: a backend's executor
# class (a subclass) is registered, and its capabilities read, by every CLI call and plan.
if TYPE_CHECKING:
    from flowrl.plugins.manager import Registry
    from flowrl.runtime.groups import GenerationGroup, TrainingGroup, Transport
    from flowrl.runtime.nodes import NodeRuntime
    from flowrl.runtime.pipeline import StepState
    from flowrl.runtime.rollout import Rounds, StepRollout
    from flowrl.runtime.schedule import Schedule, Task


def run_dir(base: str, name: str) -> Path:
    """runs/<name>, or runs/<name>-2, -3, ... so an earlier run is never overwritten. ``name`` is
    one plain folder name: nothing is written outside ``base``."""
    if not plain_name(name):
        raise ConfigError(
            f"run name '{name}' must be one plain folder name (no '/', '\\' or '..'); set --set name=NAME."
        )
    root = Path(base)
    path, i = root / name, 1
    while path.exists():
        i += 1
        path = root / f"{name}-{i}"
    try:
        path.mkdir(parents=True)
    except OSError as exc:
        raise ConfigError(
            f"cannot create the run folder '{path}' under --out '{base}': {exc.strerror or exc}."
        ) from None
    return path


class PlanExecutor:
    """Runs the schedule lowered from a plan on worker groups. This class runs one worker in this
    process (the one-rank case); a backend that starts workers elsewhere overrides `launch`."""

    capabilities = Capabilities()

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def device(self, plan: ExecutionPlan) -> str:
        """The device models are placed on (backends override)."""
        return plan.config.device

    def check(self, graph: Graph, plan: ExecutionPlan) -> None:
        """Refuse, naming the feature, what this executor cannot run; builds nothing."""
        if plan.graph.fingerprint != graph.fingerprint():
            raise PlanError(
                f"the plan was made for graph '{plan.graph.name}' {plan.graph.fingerprint}, but "
                f"'{plan.graph.source}' now builds {graph.fingerprint()}. Re-run `flowrl plan`."
            )
        if plan.layout is None or not plan.nodes:
            raise PlanError("the plan is incomplete (no placement or node plan); make it with `flowrl plan`.")
        verify_plan(graph, plan)
        backend = plan.config.backend
        replan = "Plan it for an executor that runs it: `flowrl plan ... --backend NAME` (see `flowrl plugins`)."
        missing = unsupported(self.capabilities, plan.layout, plan.target.cluster.devices)
        if missing:
            raise PlanError(
                f"executor '{backend}' cannot run this plan: it does not support {'; '.join(missing)}. {replan}"
            )
        if plan.target.capabilities is None:
            raise PlanError(
                f"this plan is a forecast for {plan.target.cluster.label} (planned with --cluster and no --backend); "
                f"executor '{backend}' runs only plans made for it. {replan}"
            )
        from flowrl.planner.modelspec import for_config
        from flowrl.tasks.tokenizer import vocab

        cfg = plan.config
        builds = for_config(cfg.model, cfg.tiny_model, len(vocab()))
        if builds != plan.target.model:
            raise PlanError(
                f"the plan is for model '{plan.target.model.name}' ({plan.target.model.parameters() / 1e6:.1f}M "
                f"parameters), but its config builds '{builds.name}' ({builds.parameters() / 1e6:.1f}M); re-plan "
                "with the model you run (--model DIR)."
            )
        other = {m: spec.name for m, spec in plan.target.models.items() if spec != builds}
        if other:
            raise PlanError(
                f"the plan gives models {', '.join(f'{m}={n}' for m, n in other.items())} shapes of their own, but a "
                f"run trains one base model ('{builds.name}') for every role; per-role models are for forecasts "
                "(`flowrl plan --cluster ... --model actor=...,reward=...`)."
            )
        conflict = rollout_conflict(graph, plan.layout.rollout)
        if conflict:
            raise PlanError(conflict)
        self.registry.entry("generation_engines", cfg.generation.engine, field="generation.engine")
        self.registry.entry("training_engines", cfg.train.engine, field="train.engine")

    # ------------------------------------------------------------ workers
    def schedule(self, graph: Graph, plan: ExecutionPlan) -> Schedule:
        from flowrl.runtime.schedule import lower

        cfg = plan.config
        return lower(graph, plan, same_engine=cfg.generation.engine == cfg.train.engine)

    def _worker(self, graph: Graph, plan: ExecutionPlan, schedule: Schedule) -> tuple[Worker, dict[str, Any]]:
        if schedule.world != 1:
            raise PlanError(f"the in-process executor runs one rank; the plan has {schedule.world}.")
        worker = Worker(0, 1, self.registry, threads=plan.config.threads, device=self.device(plan))
        return worker, worker.setup(graph.models, plan, schedule, None)

    def launch(
        self, graph: Graph, plan: ExecutionPlan, schedule: Schedule, out_dir: Path
    ) -> tuple[Transport, dict[str, Any]]:
        """Start the workers of ``schedule`` and set them up; returns the transport and, per model,
        (tokenizer, hf_config). This executor: one worker in this process."""
        from flowrl.runtime.groups import InProcessTransport

        worker, built = self._worker(graph, plan, schedule)
        return InProcessTransport(worker), built

    def engines(self, graph: Graph, plan: ExecutionPlan) -> tuple[dict[str, Any], dict[str, Any]]:
        """The engines of a one-rank plan, built in this process (for checks and tools): trainers, generators."""
        worker, _ = self._worker(graph, plan, self.schedule(graph, plan))
        return worker.trainers, worker.generators

    def groups(
        self, graph: Graph, schedule: Schedule, transport: Transport, built: dict[str, Any]
    ) -> tuple[dict[str, TrainingGroup], dict[str, GenerationGroup]]:
        """The driver's view of every model: a training group per model, a generation group per model that generates."""
        from flowrl.runtime.groups import GenerationGroup, TrainingGroup

        trainers = {
            m.model: TrainingGroup(graph.models[m.model], schedule.ranks_of(m.model), transport, *built[m.model])
            for m in schedule.models
        }
        generators = {
            m.model: GenerationGroup(m.model, schedule.generation_ranks(m.model), transport, _pad_id(built[m.model][0]))
            for m in schedule.models
            if m.generation_group is not None
        }
        return trainers, generators

    # ------------------------------------------------------------ the run
    def run(
        self,
        graph: Graph,
        plan: ExecutionPlan,
        out_dir: Path,
        *,
        on_step: Callable[[dict[str, Any]], None] | None = None,
        resume: bool = False,
    ) -> RunResult:
        """Run the plan in ``out_dir``, writing a checkpoint after every ``save_every`` steps; with
        ``resume``, continue the run in ``out_dir`` from its newest usable checkpoint. Ctrl-C or
        SIGTERM stops after the current step, with a checkpoint (``RunResult.stopped``); during
        setup they interrupt at once. One process at a time holds a run folder."""
        from flowrl.runtime import runstate

        cfg = plan.config
        stop = _StopRequest(cfg.checkpoint)
        with runstate.holding(out_dir), stop.installed():
            if resume and not runstate.resumable(out_dir, cfg.checkpoint):
                # killed before its first checkpoint: nothing to keep, start over
                result = self._run(graph, plan, out_dir, on_step, stop, False)
                result.resumed_from = 0
                return result
            return self._run(graph, plan, out_dir, on_step, stop, resume)

    def _run(
        self,
        graph: Graph,
        plan: ExecutionPlan,
        out_dir: Path,
        on_step: Callable[[dict[str, Any]], None] | None,
        stop: _StopRequest,
        resume: bool,
    ) -> RunResult:
        import torch

        from flowrl.runtime import checkpoint, runstate
        from flowrl.runtime.groups import CURRENT_TASK
        from flowrl.runtime.nodes import NodeRuntime
        from flowrl.runtime.pipeline import Pipeline

        cfg = plan.config
        task = make_task(cfg.task, cfg.task_options, registry={e.name: e.obj for e in self.registry.entries("tasks")})
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        torch.manual_seed(cfg.seed)
        stream = runstate.PromptStream(task, random.Random(cfg.seed))
        schedule = self.schedule(graph, plan)
        result = RunResult(out_dir=out_dir)
        manifest = runstate.manifest(plan)
        if not resume:
            dump_plan(plan, out_dir / "plan.yaml")  # first: a run killed during setup can be resumed
        trace = Trace(origin=time.time())  # before the workers start: their setup spans come after it
        CURRENT_TASK.set("setup")
        transport, built = self.launch(graph, plan, schedule, out_dir)
        self.transport, self.lowered = transport, schedule  # for tools and checks while the run goes on
        try:
            trace.add_workers(transport.spans())
            trainers, generators = self.groups(graph, schedule, transport, built)
            options = {}
            for name, node in graph.nodes.items():
                algo, opts = node_options(graph, name, cfg.algo, self.registry)
                if isinstance(node, Train):
                    opts = {"epochs": cfg.train.epochs, "mini_batches": cfg.train.mini_batches, **opts}
                options[name] = (algo, opts)
            kinds = ("advantage_estimators", "reward_functions", "losses", "filters", "environments")
            rt = NodeRuntime(
                graph=graph,
                functions={k: {e.name: e.obj for e in self.registry.entries(k)} for k in kinds},
                loss_outputs={e.name: e.meta.get("output", "logprobs") for e in self.registry.entries("losses")},
                task=task,
                generators=generators,
                trainers=trainers,
                options=options,
                micro_batch={n.node: n.micro_batch_size for n in plan.nodes},
                seed=cfg.seed,
                skip_nonfinite=cfg.train.skip_nonfinite,
            )
            policy = plan.layout.rollout if plan.layout is not None else RolloutPolicy()
            sources = {
                t.name: self._source(graph, t.name, generators[t.model], policy, cfg, stream, built, rt)
                for t in schedule.tasks
                if t.kind == "generate"
            }
            self.sources = sources  # for tools and tests: the rollout buffers
            state = runstate.RunState(trainers, generators, rt, sources, stream)
            snapshot = None
            metrics_path = out_dir / "metrics.jsonl"
            if resume:
                CURRENT_TASK.set("restore")

                def sync() -> None:
                    for t in schedule.tasks:
                        if t.kind == "sync":
                            run_task(rt, t, {})

                snapshot = runstate.resume(out_dir, manifest, state, sync)
                result.metrics = runstate.completed_metrics(metrics_path, snapshot.step)
                result.resumed_from = snapshot.step + 1
                result.last_checkpoint = checkpoint.step_dir(out_dir, snapshot.step)
                dump_plan(plan, out_dir / "plan.yaml")  # only now: a resume that fails changes nothing
            last = [time.perf_counter()]
            with metrics_path.open("a" if resume else "w") as fh:

                def on_done(step: int, st: StepState) -> None:
                    record = _record(schedule, step, st.outputs, time.perf_counter() - last[0])
                    record["prompts_drawn"] = stream.drawn
                    last[0] = time.perf_counter()
                    trace.add_workers(transport.spans())
                    fh.write(msgspec.json.encode(record).decode() + "\n")
                    fh.flush()
                    result.metrics.append(record)
                    if on_step is not None:
                        on_step(record)

                def on_barrier(snap: Any) -> bool:
                    CURRENT_TASK.set("checkpoint")
                    if cfg.checkpoint:
                        os.fsync(fh.fileno())
                        result.last_checkpoint = runstate.write(out_dir, snap, state, manifest, cfg.keep_checkpoints)
                    if stop.signal is not None and snap.step < cfg.steps - 1:
                        result.stopped = snap.step
                    return stop.signal is not None

                def prompts(step: int) -> list[Any] | None:
                    return None if policy.partial else stream(cfg.rollout.prompts_per_step)

                stop.armed = True
                Pipeline(rt, schedule, policy, sources, prompts, trace, transport, run_task).run(
                    cfg.steps,
                    on_done,
                    barrier=lambda step: cfg.checkpoint_due(step) or stop.signal is not None,
                    on_barrier=on_barrier,
                    resume=snapshot,
                )
            _write_acceptance(graph, plan, result.metrics, out_dir / "plan.yaml")
            finished = cfg.steps == 0 or (bool(result.metrics) and result.metrics[-1]["step"] == cfg.steps - 1)
            if cfg.checkpoint and finished and result.stopped is None:
                first_actor = next((n for n, e in trainers.items() if e.decl.role == "actor"), None)
                for name, engine in trainers.items():
                    if engine.decl.trainable:  # the (first) actor's is `checkpoint`, every other model's its own
                        path = out_dir / ("checkpoint" if name == first_actor else f"checkpoint-{name}")
                        _publish(engine, result.last_checkpoint, path)
                        result.checkpoints[name] = path
        finally:
            stop.armed = False
            try:
                trace.add_workers(transport.spans())
            except Exception:  # a dead worker keeps its spans
                pass
            transport.close()
            ran = result.resumed_from is None or result.resumed_from < cfg.steps
            if ran:  # a resumed run keeps the trace of the session before it
                runstate.archive_trace(out_dir, result.resumed_from)
                trace.write(out_dir, plan, graph, schedule)
        if result.metrics:
            from flowrl.runtime.report import plot_rewards

            plot_rewards(result.metrics, out_dir / "reward.png", title=f"{graph.name} on {cfg.task}")
        return result

    def _source(
        self,
        graph: Graph,
        node: str,
        generator: GenerationGroup,
        policy: RolloutPolicy,
        cfg: Any,
        stream: Callable[[int], list[Any]],
        built: dict[str, Any],
        rt: NodeRuntime,
    ) -> StepRollout:
        from flowrl.runtime.rollout import StepRollout

        gen = graph.nodes[node]
        assert isinstance(gen, Generate)
        return StepRollout(
            model=gen.model,
            generator=generator,
            n=1 if gen.greedy else gen.n,
            greedy=gen.greedy,
            policy=policy,
            prompts_per_step=cfg.rollout.prompts_per_step,
            chunk_tokens=policy.chunk_tokens
            or cfg.rollout.chunk_tokens
            or policy.chunk(cfg.rollout.max_new_tokens or 16),
            stream_groups=cfg.rollout.stream_groups,
            pad_id=_pad_id(built[gen.model][0]),
            draw=stream,
            rounds=_rounds(graph, gen, rt, cfg.rollout.prompts_per_step),
            episodes=_episodes(gen, rt, built[gen.model][0], cfg),
        )


def _rounds(graph: Graph, gen: Generate, rt: NodeRuntime, prompts_per_step: int) -> Rounds | None:
    """Dynamic sampling for ``gen`` when a filter keeps groups of its rows: each round runs the
    nodes between them, then the filter."""
    from flowrl.graph.ir import Filter
    from flowrl.runtime.nodes import filter_groups, run_node
    from flowrl.runtime.rollout import Rounds

    name = graph.filters().get(gen.name)
    if name is None:
        return None
    _, between = graph.filter_segment(name)
    node = graph.nodes[name]
    assert isinstance(node, Filter)

    def run(prompts: list[Any], seqs: Any, logprobs: Any) -> tuple[dict[str, Any], Any, dict[str, dict[str, Any]]]:
        batch = dict(zip((gen.reads[0], *gen.writes), (prompts, seqs, logprobs)))
        metrics = {}
        for inner in between:
            start = time.perf_counter()
            out, node_metrics = run_node(rt, inner, batch)
            metrics[inner] = (time.perf_counter() - start, node_metrics)
            batch.update(out)
        start = time.perf_counter()
        keep, _ = filter_groups(rt, name, batch)
        metrics[name] = (time.perf_counter() - start, {})
        return {k: batch[k] for inner in between for k in graph.nodes[inner].writes}, keep, metrics

    return Rounds(run=run, groups=node.groups or prompts_per_step, max_rounds=node.max_rounds, filter=name)


def _episodes(gen: Generate, rt: NodeRuntime, tokenizer: Any, cfg: Any) -> Any:
    """Multi-turn episodes for a generate node with an environment."""
    if gen.env is None:
        return None
    from flowrl.runtime.episodes import Episodes

    factory = rt.functions["environments"][gen.env]
    _, options = rt.options[gen.name]
    return Episodes.build(gen, factory, rt.task, options, tokenizer, cfg.rollout.max_new_tokens or 16)


class _StopRequest:
    """Ctrl-C or SIGTERM: while steps run (``armed``), stop after the current step with a
    checkpoint; before (setup), or a second time, interrupt at once."""

    def __init__(self, checkpoint: bool) -> None:
        self.signal: int | None = None
        self.armed = False
        self.checkpoint = checkpoint

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signal is not None or not self.armed:
            raise KeyboardInterrupt
        self.signal = signum
        what = "and writing a checkpoint " if self.checkpoint else "(checkpoint=false: no checkpoint) "
        print(
            f"\nflowrl: stopping after the current step {what}- Ctrl-C again to abort at once",
            file=sys.stderr,
            flush=True,
        )

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def _write_acceptance(graph: Graph, plan: ExecutionPlan, metrics: list[dict[str, Any]], path: Path) -> None:
    """A run of a graph with a filter measured its acceptance rate (the fraction of sampled groups
    the filter passed, over every step): it goes into the run's plan.yaml workload, where the
    planner reads it to cost dynamic sampling's extra generation (`flowrl plan --workload
    runs/NAME/plan.yaml`)."""
    workload = plan.target.workload
    keys = [f"{name}/acceptance" for name in graph.filters().values()]
    values = [m[k] for m in metrics for k in keys if isinstance(m.get(k), (int, float))]
    if workload is None or not values:
        return
    rate = min(max(sum(values) / len(values), 0.01), 1.0)
    target = msgspec.structs.replace(
        plan.target, workload=msgspec.structs.replace(workload, acceptance_rate=round(rate, 4))
    )
    dump_plan(msgspec.structs.replace(plan, target=target).sealed(), path)  # a new content id: the plan changed


def _publish(engine: TrainingGroup, step_checkpoint: Path | None, path: Path) -> None:
    """The model's HF checkpoint at ``path``: its folder in the last step checkpoint (hard links
    where the filesystem allows), or written now when no step ran; replaces an older one atomically."""
    from flowrl.runtime.checkpoint import atomic_dir

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    with atomic_dir(path) as tmp:
        if step_checkpoint is None:
            engine.save(tmp.resolve())
        else:
            shutil.copytree(step_checkpoint / "models" / engine.decl.name, tmp, dirs_exist_ok=True, copy_function=link)


def _record(
    schedule: Schedule, step: int, outputs: dict[str, tuple[float, dict[str, Any]]], seconds: float
) -> dict[str, Any]:
    """One step's metrics line: every task's metrics (prefixed by its name), the headline metrics,
    generated tokens and the step's wall-clock (since the step before it ended)."""
    from flowrl.runtime.nodes import HEADLINE

    record: dict[str, Any] = {"step": step}
    spans: dict[str, float] = {}
    tokens, gen_seconds = 0, 0.0
    for task in schedule.tasks:  # metrics in schedule order, so headline metrics do not depend on timing
        took, metrics = outputs[task.name]
        spans[task.name] = round(took, 5)
        if task.kind == "generate":
            tokens += int(metrics["tokens"])
            gen_seconds += took
        for name in task.absorbs:  # nodes that ran inside the generate task (dynamic sampling)
            spans[name] = round(outputs[name][0], 5)
        for name in (task.name, *task.absorbs):
            for key, value in outputs[name][1].items():
                record[f"{name}/{key}"] = value
                if key in HEADLINE:
                    record.setdefault(key, value)
    record.setdefault("reward", None)
    record["tokens"] = tokens
    record["tokens_per_s"] = round(tokens / max(gen_seconds, 1e-9), 1)
    record["step_seconds"] = round(seconds, 5)
    record["spans"] = spans
    return record


def _pad_id(tokenizer: Any) -> int:
    """The token rows from several ranks are padded with (0 when an engine has no tokenizer: masks say what is real)."""
    pad = getattr(tokenizer, "pad_token_id", None)
    return 0 if pad is None else int(pad)


def run_task(rt: NodeRuntime, task: Task, batch: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """One task of the schedule: a graph node, or a weight sync (workers move the weights)."""
    from flowrl.runtime.nodes import run_node

    if task.kind == "sync":
        trainer = rt.trainers[task.model]
        gen = rt.generators[task.model]
        ranks = sorted({*trainer.ranks, *gen.ranks})
        stats = trainer.transport.call(
            ranks, "sync", [(task.model, task.strategy, trainer.version)] * len(ranks), task.name
        )
        gen.version = trainer.version
        return {}, {"bytes": max(s["bytes"] for s in stats), "strategy": task.strategy}
    return run_node(rt, task.name, batch)
