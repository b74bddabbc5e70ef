"""The local executor: drives iterations of a graph under an ExecutionPlan.

Each step draws prompts from the task, runs the nodes in topological order (a node sees only
the keys it declares), records a span per node, and logs one metrics line. At the end it
writes an HF-format checkpoint per trainable model and a reward-curve PNG.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import msgspec
import torch

from flowrl.algorithms.advantages import masked_mean
from flowrl.algorithms.losses import kl_penalty
from flowrl.errors import GraphError, PlanError
from flowrl.graph.ir import Compute, Forward, Generate, Graph, Reward, Train
from flowrl.planner.plan import ExecutionPlan, dump_plan
from flowrl.plugins.manager import Registry
from flowrl.runtime.batch import Sequences, sequences_in
from flowrl.specs import AlgoConfig
from flowrl.tasks.builtin import make_task

ENGINE_OPTIONS = ("epochs", "mini_batches")
ALGO_FIELDS = set(AlgoConfig.__struct_fields__)


@dataclass
class RunResult:
    out_dir: Path
    metrics: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: dict[str, Path] = field(default_factory=dict)


def split_options(node: str, options: dict[str, Any], algo: AlgoConfig, allowed: tuple[str, ...]) -> tuple[AlgoConfig, dict[str, Any]]:
    """Node options that name AlgoConfig fields override it; the rest must be in ``allowed``."""
    overrides = {k: v for k, v in options.items() if k in ALGO_FIELDS}
    rest = {k: v for k, v in options.items() if k not in ALGO_FIELDS}
    bad = [k for k in rest if k not in allowed]
    if bad:
        raise GraphError(f"node '{node}': unknown option(s) {', '.join(bad)}; allowed: {', '.join(sorted([*allowed, *ALGO_FIELDS]))}.")
    try:
        algo = msgspec.convert({**msgspec.to_builtins(algo), **overrides}, AlgoConfig)
    except msgspec.ValidationError as exc:
        raise GraphError(f"node '{node}': bad option: {exc}") from None
    return algo, rest


def run_dir(base: str, name: str) -> Path:
    """runs/<name>, or runs/<name>-2, -3, ... so an earlier run is never overwritten."""
    root = Path(base)
    path, i = root / name, 1
    while path.exists():
        i += 1
        path = root / f"{name}-{i}"
    path.mkdir(parents=True)
    return path


class Executor:
    def __init__(self, graph: Graph, plan: ExecutionPlan, registry: Registry) -> None:
        if plan.graph.fingerprint != graph.fingerprint():
            raise PlanError(f"the plan was made for graph '{plan.graph.name}' {plan.graph.fingerprint}, but '{plan.graph.source}' now builds {graph.fingerprint()}. Re-run `flowrl plan`.")
        if not plan.nodes or not plan.models:
            raise PlanError("the plan is incomplete (no node or model placement); make it with `flowrl plan`.")
        self.graph, self.plan, self.registry = graph, plan, registry
        self.cfg = plan.config
        self.task = make_task(self.cfg.task, self.cfg.task_options, registry={e.name: e.obj for e in registry.entries("tasks")})
        if self.cfg.threads:
            torch.set_num_threads(self.cfg.threads)
        torch.manual_seed(self.cfg.seed)
        self.generator = torch.Generator().manual_seed(self.cfg.seed)
        self.prompt_rng = random.Random(self.cfg.seed)
        self.engines = registry.get("backends", plan.backend)(plan).build(graph)
        self.order = graph.order()
        self.reward_key = _reward_key(graph)
        self.node_options = {}
        for name in self.order:
            node = graph.nodes[name]
            allowed = ENGINE_OPTIONS if isinstance(node, Train) else tuple(_kwargs(registry, node))
            self.node_options[name] = split_options(name, dict(node.options), self.cfg.algo, allowed)

    # ------------------------------------------------------------ one node
    def _run_node(self, name: str, batch: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float]]:
        node = self.graph.nodes[name]
        inputs = {k: batch[k] for k in node.reads}
        algo, options = self.node_options[name]
        stats: dict[str, float] = {}
        if isinstance(node, Generate):
            prompts = inputs[node.reads[0]]
            seqs, logprobs = self.engines[node.model].generate(prompts, n=1 if node.greedy else node.n, greedy=node.greedy, generator=self.generator)
            values: list[Any] = [seqs, logprobs]
            if len(node.writes) > 2:
                raise GraphError(f"node '{name}': a generate node writes (responses[, logprobs]); it declares {len(node.writes)} keys.")
            out = dict(zip(node.writes, values))
            stats["tokens"] = seqs.num_tokens()
        elif isinstance(node, Forward):
            out = {node.writes[0]: self.engines[node.model].forward(sequences_in(inputs, name), node.output, name)}
        elif isinstance(node, Reward):
            seqs = sequences_in(inputs, name)
            prompts = next((v for v in inputs.values() if isinstance(v, list)), None)
            if prompts is None:
                raise GraphError(f"node '{name}' must read the prompts key to score responses.")
            fn = self.registry.get("reward_functions", node.fn)
            rows = [prompts[i] for i in seqs.prompt_index.tolist()]
            scores = fn(rows, list(seqs.texts), self.task, **options)
            out = {node.writes[0]: torch.as_tensor(scores, dtype=torch.float32)}
        elif isinstance(node, Compute):
            with torch.no_grad():
                out = self.registry.get("advantage_estimators", node.fn)(inputs, algo, **options)
        elif isinstance(node, Train):
            seqs_key = next(k for k, v in inputs.items() if isinstance(v, Sequences))
            loss = self.registry.entry("losses", node.loss)
            stats = self.engines[node.model].train(loss, inputs, seqs_key, name, dict(options), algo, self.generator)
            out = {node.writes[0]: stats} if node.writes else {}
        else:  # pragma: no cover - the IR is a closed set
            raise GraphError(f"node '{name}' has unknown kind {node.kind}")
        missing = [k for k in node.writes if k not in out]
        if missing:
            raise GraphError(f"node '{name}' did not produce its declared key(s) {', '.join(missing)}.")
        return {k: out[k] for k in node.writes}, stats

    # ------------------------------------------------------------ one iteration
    def step(self, step: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        batch: dict[str, Any] = {"prompts": self.task.prompts(self.prompt_rng, self.cfg.rollout.prompts_per_step)}
        record: dict[str, Any] = {"step": step}
        spans: dict[str, float] = {}
        tokens = 0
        gen_seconds = 0.0
        for name in self.order:
            s = time.perf_counter()
            out, stats = self._run_node(name, batch)
            spans[name] = round(time.perf_counter() - s, 5)
            batch.update(out)
            node = self.graph.nodes[name]
            if isinstance(node, Generate):
                tokens += int(stats["tokens"])
                gen_seconds += spans[name]
            elif isinstance(node, Train):
                record.update({f"{name}/{k}": round(v, 6) for k, v in stats.items()})
            elif isinstance(node, Reward):
                record[f"reward/{node.writes[0]}"] = round(float(out[node.writes[0]].mean()), 6)
        seconds = time.perf_counter() - t0
        record["reward"] = record.get(f"reward/{self.reward_key}")
        first_gen = next(n for n in self.order if isinstance(self.graph.nodes[n], Generate))
        seqs = batch[self.graph.nodes[first_gen].writes[0]]
        if "old_logprobs" in batch and "ref_logprobs" in batch:
            kl = kl_penalty(batch["old_logprobs"], batch["ref_logprobs"], "k3")
            record["kl"] = round(float(masked_mean(kl, seqs.response_mask)), 6)
        record["response_length"] = round(float(seqs.response_lengths.float().mean()), 3)
        record["exact"] = round(sum(self.task.score(batch["prompts"][i], t) == 1.0 for i, t in zip(seqs.prompt_index.tolist(), seqs.texts)) / len(seqs), 4)
        record["tokens"] = tokens
        record["tokens_per_s"] = round(tokens / max(gen_seconds, 1e-9), 1)
        record["step_seconds"] = round(seconds, 5)
        record["spans"] = spans
        record["sample"] = f"{batch['prompts'][0].text}{seqs.texts[0]}"
        return record

    # ------------------------------------------------------------ the run
    def run(self, out_dir: Path, *, on_step: Callable[[dict[str, Any]], None] | None = None) -> RunResult:
        result = RunResult(out_dir=out_dir)
        dump_plan(self.plan, out_dir / "plan.yaml")
        metrics_path = out_dir / "metrics.jsonl"
        with metrics_path.open("w") as fh:
            for step in range(self.cfg.steps):
                record = self.step(step)
                fh.write(msgspec.json.encode(record).decode() + "\n")
                fh.flush()
                result.metrics.append(record)
                if on_step is not None:
                    on_step(record)
        if self.cfg.checkpoint:
            for name, engine in self.engines.items():
                if engine.decl.trainable:
                    path = out_dir / ("checkpoint" if engine.decl.role == "actor" else f"checkpoint-{name}")
                    engine.save(path)
                    result.checkpoints[name] = path
        if result.metrics:
            from flowrl.runtime.report import plot_rewards

            plot_rewards(result.metrics, out_dir / "reward.png", title=f"{self.graph.name} on {self.cfg.task}")
        return result


def _reward_key(graph: Graph) -> str | None:
    keys = [n.writes[0] for n in graph.nodes.values() if isinstance(n, Reward)]
    return "rewards" if "rewards" in keys else (keys[0] if keys else None)


def _kwargs(registry: Registry, node: Any) -> list[str]:
    import inspect

    if isinstance(node, Compute):
        fn = registry.get("advantage_estimators", node.fn)
    elif isinstance(node, Reward):
        fn = registry.get("reward_functions", node.fn)
    else:
        return []
    return [p.name for p in inspect.signature(fn).parameters.values() if p.kind == p.KEYWORD_ONLY or (p.kind == p.POSITIONAL_OR_KEYWORD and p.default is not p.empty)]
