"""The in-process executor: drives iterations of a graph under an ExecutionPlan.

Engines come from the registry by the names the run config gives per role
(``train.engine`` for every model, ``generation.engine`` for models that generate); when both
name the same engine, generation uses the training engine's weights in place, otherwise the
generation engine takes the new weights after every train step. Each step draws prompts from
the task, runs the nodes in topological order (a node sees only the keys it declares), records
a span per node, and logs one metrics line of what the nodes report. At the end it writes a
checkpoint per trainable model and a reward-curve PNG.

A backend registers an executor built on this class with its capabilities; `check` refuses a
plan it cannot run before any model is built.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from flowrl.errors import BackendError, PlanError
from flowrl.graph.ir import Generate, Graph, Train
from flowrl.planner.capabilities import Capabilities, unsupported
from flowrl.planner.passes import node_options, verify_plan
from flowrl.planner.plan import ExecutionPlan, dump_plan
from flowrl.runtime.protocols import EngineContext, GenerationEngine, RunResult, TrainingEngine
from flowrl.tasks.builtin import make_task

if TYPE_CHECKING:
    from flowrl.plugins.manager import Entry, Registry
    from flowrl.runtime.nodes import NodeRuntime


def run_dir(base: str, name: str) -> Path:
    """runs/<name>, or runs/<name>-2, -3, ... so an earlier run is never overwritten."""
    root = Path(base)
    path, i = root / name, 1
    while path.exists():
        i += 1
        path = root / f"{name}-{i}"
    path.mkdir(parents=True)
    return path


def init_order(graph: Graph) -> list[str]:
    """Models in an order where each comes after the model it initialises from."""
    done: list[str] = []
    pending = list(graph.models)
    while pending:
        name = next(m for m in pending if graph.models[m].init_from is None or graph.models[m].init_from in done)
        done.append(name)
        pending.remove(name)
    return done


def _checked(engine: Any, protocol: type, entry: Entry, model: str) -> Any:
    """``engine`` if it implements ``protocol``; else a BackendError naming the engine and its plugin."""
    if isinstance(engine, protocol):
        return engine
    members = [m for m in protocol.__annotations__ if not m.startswith("_")]
    members += [m for m, v in vars(protocol).items() if callable(v) and not m.startswith("_")]
    missing = sorted({m for m in members if not hasattr(engine, m)})
    raise BackendError(
        f"{entry.name!r} (plugin '{entry.plugin}') built {type(engine).__name__} for model '{model}', which is not "
        f"a {protocol.__name__}: it lacks {', '.join(missing) or 'the protocol'} (see flowrl/runtime/protocols.py)."
    )


class InProcessExecutor:
    """Every model in this process; one device (the one-rank case of a worker group)."""

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
        self.registry.entry("generation_engines", cfg.generation.engine, field="generation.engine")
        self.registry.entry("training_engines", cfg.train.engine, field="train.engine")

    # ------------------------------------------------------------ building
    def engines(
        self, graph: Graph, plan: ExecutionPlan, device: str
    ) -> tuple[dict[str, TrainingEngine], dict[str, GenerationEngine]]:
        """(training engine per model, generation engine per model that generates). When both roles
        name the same engine and its training engine can generate, generation uses it in place."""
        cfg = plan.config
        train = self.registry.entry("training_engines", cfg.train.engine, field="train.engine")
        trainers: dict[str, TrainingEngine] = {}
        for name in init_order(graph):
            decl = graph.models[name]
            source = trainers[decl.init_from] if decl.init_from is not None else None
            engine = train.obj(EngineContext(decl=decl, plan=plan, device=device, source=source))
            trainers[name] = _checked(engine, TrainingEngine, train, name)
        generators: dict[str, GenerationEngine] = {}
        gen = self.registry.entry("generation_engines", cfg.generation.engine, field="generation.engine")
        for model in sorted({n.model for n in graph.nodes.values() if isinstance(n, Generate)}):
            trainer = trainers[model]
            if cfg.generation.engine == cfg.train.engine and isinstance(trainer, GenerationEngine):
                generators[model] = trainer  # in place: the same weights
            else:
                engine = gen.obj(EngineContext(decl=graph.models[model], plan=plan, device=device, source=trainer))
                generators[model] = _checked(engine, GenerationEngine, gen, model)
        return trainers, generators

    # ------------------------------------------------------------ the run
    def run(
        self,
        graph: Graph,
        plan: ExecutionPlan,
        out_dir: Path,
        *,
        on_step: Callable[[dict[str, Any]], None] | None = None,
    ) -> RunResult:
        import torch

        from flowrl.runtime.nodes import NodeRuntime

        cfg = plan.config
        task = make_task(cfg.task, cfg.task_options, registry={e.name: e.obj for e in self.registry.entries("tasks")})
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        torch.manual_seed(cfg.seed)
        generator = torch.Generator().manual_seed(cfg.seed)
        prompt_rng = random.Random(cfg.seed)
        trainers, generators = self.engines(graph, plan, self.device(plan))
        options = {}
        for name, node in graph.nodes.items():
            algo, opts = node_options(graph, name, cfg.algo, self.registry)
            if isinstance(node, Train):
                opts = {"epochs": cfg.train.epochs, "mini_batches": cfg.train.mini_batches, **opts}
            options[name] = (algo, opts)
        kinds = ("advantage_estimators", "reward_functions", "losses")
        rt = NodeRuntime(
            graph=graph,
            functions={k: {e.name: e.obj for e in self.registry.entries(k)} for k in kinds},
            loss_outputs={e.name: e.meta.get("output", "logprobs") for e in self.registry.entries("losses")},
            task=task,
            generators=generators,
            trainers=trainers,
            options=options,
            micro_batch={n.node: n.micro_batch_size for n in plan.nodes},
            generator=generator,
        )
        order = graph.order()
        result = RunResult(out_dir=out_dir)
        dump_plan(plan, out_dir / "plan.yaml")
        with (out_dir / "metrics.jsonl").open("w") as fh:
            for step in range(cfg.steps):
                record = self._step(rt, order, step, task.prompts(prompt_rng, cfg.rollout.prompts_per_step))
                fh.write(msgspec.json.encode(record).decode() + "\n")
                fh.flush()
                result.metrics.append(record)
                if on_step is not None:
                    on_step(record)
        if cfg.checkpoint:
            for name, engine in trainers.items():
                if engine.decl.trainable:
                    path = out_dir / ("checkpoint" if engine.decl.role == "actor" else f"checkpoint-{name}")
                    engine.save(path)
                    result.checkpoints[name] = path
        if result.metrics:
            from flowrl.runtime.report import plot_rewards

            plot_rewards(result.metrics, out_dir / "reward.png", title=f"{graph.name} on {cfg.task}")
        return result

    def _step(self, rt: NodeRuntime, order: list[str], step: int, prompts: list[Any]) -> dict[str, Any]:
        from flowrl.runtime.nodes import HEADLINE, run_node

        t0 = time.perf_counter()
        batch: dict[str, Any] = {"prompts": prompts}
        record: dict[str, Any] = {"step": step}
        spans: dict[str, float] = {}
        tokens, gen_seconds = 0, 0.0
        for name in order:
            s = time.perf_counter()
            out, metrics = run_node(rt, name, batch)
            node = rt.graph.nodes[name]
            if isinstance(node, Train) and rt.generators.get(node.model) not in (None, rt.trainers[node.model]):
                trainer = rt.trainers[node.model]
                rt.generators[node.model].load_weights(trainer.export_weights(), trainer.version)
            spans[name] = round(time.perf_counter() - s, 5)
            batch.update(out)
            if isinstance(node, Generate):
                tokens += int(metrics["tokens"])
                gen_seconds += spans[name]
            for key, value in metrics.items():
                record[f"{name}/{key}"] = value
                if key in HEADLINE:
                    record.setdefault(key, value)
        record.setdefault("reward", None)
        record["tokens"] = tokens
        record["tokens_per_s"] = round(tokens / max(gen_seconds, 1e-9), 1)
        record["step_seconds"] = round(time.perf_counter() - t0, 5)
        record["spans"] = spans
        return record
