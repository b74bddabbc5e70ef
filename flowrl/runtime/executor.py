"""The executor: runs the schedule lowered from a plan on worker groups, the same for every backend.

`PlanExecutor.check` refuses a plan it cannot run before any model is built (the one place a
plan is checked on its way in). `PlanExecutor.run` lowers the plan (`flowrl.runtime.schedule`),
starts the workers (`launch`: here one `Worker` in this process; the Ray backend one actor per
device), assembles the run's parts (`flowrl.runtime.assemble`) and drives the `Pipeline` step by
step: metrics go to `flowrl.runtime.metrics`, checkpoints to `flowrl.runtime.runstate`.
Nothing re-plans or re-resolves at run time.

A backend subclasses it with what it can place and schedule (``capabilities``); what a plan
may ask of engines (model parallelism, offload, numerics) is what the engines declare.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from flowrl.contract.capabilities import Capabilities, for_run, rollout_conflict, unsupported
from flowrl.contract.plan import ExecutionPlan, dump_plan
from flowrl.contract.protocols import RunResult
from flowrl.contract.reading import verify_plan
from flowrl.errors import ConfigError, PlanError, plain_name
from flowrl.graph.ir import Graph
from flowrl.runtime.trace import Trace

# The modules that import torch load when a plan runs, not with this module: a backend's executor
# class (a subclass) is registered, and its capabilities read, by every CLI call and plan.
if TYPE_CHECKING:
    from flowrl.contract.predict import Predictor
    from flowrl.plugins.manager import Registry
    from flowrl.runtime.groups import Transport
    from flowrl.runtime.schedule import Schedule
    from flowrl.runtime.worker import Worker


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

    def _claim(self, graph: Graph) -> None:
        """A graph from a file runs its own functions, whichever graph file was loaded since; any other graph
        runs the built-ins' and plugins' (none a graph file shadows)."""
        self.registry.claim(*(graph.file_functions or ("", ())))

    def check(self, graph: Graph, plan: ExecutionPlan) -> None:
        """Refuse, naming the feature, what this executor cannot run; builds nothing."""
        self._claim(graph)
        if plan.graph.fingerprint != graph.fingerprint():
            raise PlanError(
                f"the plan was made for graph '{plan.graph.name}' {plan.graph.fingerprint}, but "
                f"'{plan.graph.source}' now builds {graph.fingerprint()}. Re-run `flowrl plan`."
            )
        if plan.layout is None or not plan.nodes or not plan.models or not plan.options:
            raise PlanError(
                "the plan is incomplete (no placement, node plans or resolved options and models: made by an "
                "older flowrl?); make it again with `flowrl plan`."
            )
        for what, planned, graph_has in (
            ("nodes (options)", plan.options, graph.nodes),
            ("models", plan.models, graph.models),
        ):
            if sorted(planned) != sorted(graph_has):
                raise PlanError(
                    f"the plan resolves {what} {', '.join(sorted(planned))}, but the graph has "
                    f"{', '.join(sorted(graph_has))}; make the plan again with `flowrl plan`."
                )
        verify_plan(graph, plan)
        _check_resolved(graph, plan)
        backend = plan.config.executor
        replan = "Plan it for an executor that runs it: `flowrl plan ... --executor NAME` (see `flowrl plugins`)."
        runs = plan.models.values()
        engines = [r.training_engine for r in runs], [r.generation_engine for r in runs if r.generation_engine]
        caps = for_run(self.capabilities, self.registry, *engines)
        missing = unsupported(caps, plan.layout, plan.target.cluster.devices)
        if missing:
            raise PlanError(
                f"executor '{backend}' cannot run this plan: it does not support {'; '.join(missing)}. {replan}"
            )
        if plan.target.capabilities is None:
            raise PlanError(
                f"this plan is a forecast for {plan.target.cluster.label} (planned with --cluster and no --executor); "
                f"executor '{backend}' runs only plans made for it. {replan}"
            )
        from flowrl.contract.model import for_config
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
        for run in runs:  # the engines the plan names are installed here
            self.registry.entry("training_engines", run.training_engine, field="train.engine")
            if run.generation_engine is not None:
                self.registry.entry("generation_engines", run.generation_engine, field="generation.engine")

    # ------------------------------------------------------------ workers
    def schedule(self, graph: Graph, plan: ExecutionPlan) -> Schedule:
        from flowrl.runtime.schedule import lower

        cfg = plan.config
        return lower(graph, plan, same_engine=cfg.generation.engine == cfg.train.engine)

    def _worker(self, graph: Graph, plan: ExecutionPlan, schedule: Schedule) -> tuple[Worker, dict[str, Any]]:
        if schedule.world != 1:
            raise PlanError(f"the in-process executor runs one rank; the plan has {schedule.world}.")
        from flowrl.runtime.worker import Worker  # torch loads with the first worker, not with the registry

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

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """What `run` connects to and keeps across the restarts of one run (`flowrl.runtime.recovery`);
        this executor connects to nothing. A backend with a cluster keeps its connection until the end."""
        yield

    def devices(self, plan: ExecutionPlan) -> int | None:
        """How many devices of ``plan``'s kind this executor could place now; None: it cannot tell (this
        executor: its one device is this process's, never lost)."""
        return None

    # ------------------------------------------------------------ the run
    def run(
        self,
        graph: Graph,
        plan: ExecutionPlan,
        out_dir: Path,
        *,
        on_step: Callable[[dict[str, Any]], None] | None = None,
        resume: bool = False,
        predictor: Predictor | None = None,
        events: Sequence[dict[str, Any]] = (),
    ) -> RunResult:
        """Run the plan in ``out_dir``, writing a checkpoint after every ``save_every`` steps; with
        ``resume``, continue the run in ``out_dir`` from its newest usable checkpoint. Ctrl-C or
        SIGTERM stops after the current step, with a checkpoint (``RunResult.stopped``); during
        setup they interrupt at once. One process at a time holds a run folder. ``predictor``: what
        the run's timeline is drawn against (None: what it measured alone). ``events``: records
        (a restart's) written to metrics.jsonl after the steps the run continues from."""
        from flowrl.runtime import runstate
        from flowrl.runtime.compute import serial_here

        self._claim(graph)
        cfg = plan.config
        stop = _StopRequest(cfg.checkpoint)
        # the engines compute on the compute thread; this thread only routes (flowrl.runtime.compute)
        with runstate.holding(out_dir), stop.installed(), serial_here():
            if not resume or not runstate.resumable(out_dir, cfg.checkpoint):
                # killed before its first checkpoint (or a new run in a folder with a run's files): it starts over,
                # the earlier metrics and samples kept beside it
                runstate.set_aside(out_dir, why=" (the run starts over: it has no checkpoint)" if resume else "")
            if resume and not runstate.resumable(out_dir, cfg.checkpoint):
                result = self._run(graph, plan, out_dir, on_step, stop, False, predictor, events)
                result.resumed_from = 0
                return result
            return self._run(graph, plan, out_dir, on_step, stop, resume, predictor, events)

    def _run(
        self,
        graph: Graph,
        plan: ExecutionPlan,
        out_dir: Path,
        on_step: Callable[[dict[str, Any]], None] | None,
        stop: _StopRequest,
        resume: bool,
        predictor: Predictor | None = None,
        events: Sequence[dict[str, Any]] = (),
    ) -> RunResult:
        import torch

        from flowrl.runtime import runstate
        from flowrl.runtime.assemble import assemble
        from flowrl.runtime.checkpoint import step_dir
        from flowrl.runtime.compute import set_compute_threads
        from flowrl.runtime.groups import CURRENT_TASK
        from flowrl.runtime.metrics import MetricsLog, write_acceptance
        from flowrl.runtime.pipeline import Pipeline
        from flowrl.runtime.reports import Reports
        from flowrl.runtime.trackers import check_loggers, open_trackers

        cfg = plan.config
        if cfg.threads:
            set_compute_threads(cfg.threads)
        torch.manual_seed(cfg.seed)
        result = RunResult(out_dir=out_dir)
        manifest = runstate.manifest(plan)
        if not resume:
            dump_plan(plan, out_dir / "plan.yaml")  # first: a run killed during setup can be resumed
        trace = Trace(origin=time.time())  # before the workers start: their setup spans come after it
        CURRENT_TASK.set("setup")
        check_loggers(cfg.log.loggers)  # a tracker that is not installed fails before workers start
        schedule = self.schedule(graph, plan)
        parts = assemble(graph, plan, self.registry, schedule, lambda sched: self.launch(graph, plan, sched, out_dir))
        transport = parts.transport
        self.transport, self.lowered, self.sources = transport, schedule, parts.sources  # for tools and tests
        log: MetricsLog | None = None
        reports: Reports | None = None
        try:
            trace.add_workers(transport.spans())
            state = runstate.RunState(parts.trainers, parts.generators, parts.rt, parts.sources, parts.stream)
            snapshot = None
            metrics_path = out_dir / "metrics.jsonl"
            if resume:
                CURRENT_TASK.set("restore")
                snapshot = runstate.resume(out_dir, manifest, state, parts.publish_all)
                result.metrics, result.evals = runstate.completed_metrics(metrics_path, snapshot.step)
                result.resumed_from = snapshot.step + 1
                result.last_checkpoint = step_dir(out_dir, snapshot.step)
                dump_plan(plan, out_dir / "plan.yaml")  # only now: a resume that fails changes nothing
            log = MetricsLog(
                metrics_path,
                schedule,
                result,
                trace,
                transport.spans,
                lambda: parts.stream.drawn,
                on_step,
                append=resume,
                trackers=open_trackers(cfg.log.loggers, out_dir, out_dir.name, msgspec.to_builtins(cfg), resume),
                reward_node=next((n.name for n in graph.nodes.values() if "rewards" in n.writes), None),
            )
            for event in events:  # after the steps kept from before: in step order
                log.log_extra(dict(event))
            reports = Reports(cfg, plan, parts, out_dir, log, result, on_step, resume)
            if not resume:
                reports.evaluate(0)

            def on_barrier(snap: Any) -> bool:
                reports.evaluate(snap.step + 1)
                CURRENT_TASK.set("checkpoint")
                if cfg.checkpoint:
                    log.sync()
                    result.last_checkpoint = runstate.write(out_dir, snap, state, manifest, cfg.keep_checkpoints)
                if stop.signal is not None and snap.step < cfg.steps - 1:
                    result.stopped = snap.step
                return stop.signal is not None

            stop.armed = True
            Pipeline(parts, trace).run(
                cfg.steps,
                reports.step_done,
                barrier=lambda step: cfg.checkpoint_due(step) or stop.signal is not None or reports.eval_due(step),
                on_barrier=on_barrier,
                resume=snapshot,
            )
            write_acceptance(graph, plan, result.metrics, out_dir / "plan.yaml")
            finished = cfg.steps == 0 or (bool(result.metrics) and result.metrics[-1]["step"] == cfg.steps - 1)
            if cfg.checkpoint and finished and result.stopped is None:
                result.checkpoints = runstate.publish_models(out_dir, parts.trainers, result.last_checkpoint)
        finally:
            stop.armed = False
            if log is not None:
                log.close()
            if reports is not None:
                reports.close()
            try:
                trace.add_workers(transport.spans())
            except Exception:  # a dead worker keeps its spans
                pass
            for source in parts.sources.values():  # the agents' endpoints
                source.close()
            transport.close()
            parts.rt.rewards.close()  # the reward workers
            ran = result.resumed_from is None or result.resumed_from < cfg.steps
            if ran:  # a resumed run keeps the trace of the session before it
                runstate.archive_trace(out_dir, result.resumed_from)
                trace.write(out_dir, plan, graph, schedule, predictor)
        if result.metrics:
            from flowrl.runtime.report import plot_rewards

            plot_rewards(
                result.metrics, out_dir / "reward.png", title=f"{graph.name} on {cfg.task}", evals=result.evals
            )
        return result


def _check_resolved(graph: Graph, plan: ExecutionPlan) -> None:
    """The plan's resolved sections (each model's run, each node's options: what runs) agree with the
    config they were resolved from: a config field edited in a plan file afterwards would otherwise
    be ignored. This compares what `resolve` copied; it re-derives nothing."""
    from flowrl.contract.reading import episode_budget, model_checkpoints

    cfg = plan.config
    folders = model_checkpoints(graph, cfg.model)  # config field 'model': one folder, or one per model
    for name, run in plan.models.items():
        decl = graph.models[name]
        fields: dict[str, tuple[Any, Any]] = {
            "train.engine": (cfg.train.engine, run.training_engine),
            "seed": (cfg.seed, run.seed),
            "model": (folders.get(name), run.checkpoint),
            "tiny_model": (cfg.tiny_model, run.tiny),
            "rollout.temperature": (cfg.rollout.temperature, run.sampling.temperature),
            "rollout.top_p": (cfg.rollout.top_p, run.sampling.top_p),
            "rollout.max_new_tokens": (
                episode_budget(graph, name, cfg.rollout.max_new_tokens or 0),
                run.sampling.max_new_tokens,
            ),
            "rollout.ignore_eos": (cfg.rollout.ignore_eos, run.sampling.ignore_eos),
            "rollout.stop": (tuple(cfg.rollout.stop), tuple(run.sampling.stop)),
            "generation.dtype": (cfg.generation.dtype, run.sampling.dtype),
        }
        if run.generation_engine is not None:
            fields["generation.engine"] = (cfg.generation.engine, run.generation_engine)
        if run.optimizer is not None:
            lr = cfg.train.critic_lr if decl.scalar_head and cfg.train.critic_lr else cfg.train.lr
            opt = run.optimizer
            fields["train.critic_lr" if lr != cfg.train.lr else "train.lr"] = (lr, opt.lr)
            fields["train.betas"] = (tuple(cfg.train.betas), tuple(opt.betas))
            fields["train.weight_decay"] = (cfg.train.weight_decay, opt.weight_decay)
            fields["train.grad_clip"] = (cfg.train.grad_clip, opt.grad_clip)
            fields["train.skip_nonfinite"] = (cfg.train.skip_nonfinite, opt.skip_nonfinite)
        _agree(fields, f"model '{name}'")
    algo = msgspec.to_builtins(cfg.algo)
    train_fields = {"epochs": cfg.train.epochs, "mini_batches": cfg.train.mini_batches}
    for name, resolved in plan.options.items():
        node = graph.nodes[name]
        given = {**node.options, **cfg.nodes.get(name, {})}
        resolved_algo = msgspec.to_builtins(resolved.algo)
        fields = {}
        for key, value in algo.items():
            where = f"nodes.{name}.{key}" if key in cfg.nodes.get(name, {}) else f"algo.{key}"
            fields[where] = (given.get(key, value), resolved_algo[key])
        for key, value in given.items():
            if key not in algo:
                fields[f"nodes.{name}.{key}"] = (value, resolved.options.get(key))
        if node.trains:
            for key, value in train_fields.items():
                fields[f"train.{key}" if key not in given else f"nodes.{name}.{key}"] = (
                    given.get(key, value),
                    resolved.options.get(key),
                )
        _agree(fields, f"node '{name}'")


def _agree(fields: dict[str, tuple[Any, Any]], whose: str) -> None:
    for field, (said, resolved) in fields.items():
        if said != resolved:
            raise PlanError(
                f"config field '{field}' is {said!r} in the plan, but {whose} was resolved with {resolved!r}: "
                "the plan was edited after it was made. Re-plan with `flowrl plan` (the plan's 'models' and "
                "'options' sections are what runs), or edit both."
            )


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
