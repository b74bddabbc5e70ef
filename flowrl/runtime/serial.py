"""The serial reference loop: what one step of a graph is, top to bottom, in one process.

No schedule, pipeline, worker, transport, thread pool or asynchrony: each iteration draws the
step's prompts, then runs the graph's nodes in topological order on the batch of keys written so
far, calling the engines and the node functions directly. A step is:

1. **prompts**: the task's next ``rollout.prompts_per_step`` prompts (a seeded stream);
2. **generate**: ``n`` responses per prompt, sampled with the policy's current weights, each token
   with its log-prob and the weight version that sampled it;
3. **forward**: a model's per-token log-probs or values (a reward model's scores) of the responses;
4. **reward**: a reward function scores each response against its prompt;
5. **compute**: advantages, returns, ... (plain tensor functions over the keys they read);
6. **train**: ``epochs`` x ``mini_batches`` optimizer steps of the node's loss; the model's version + 1;
7. **weight sync**: the next step samples with the trained weights.

It runs what the plan resolved (engines and their specs, node options, micro-batch sizes, seed),
not what makes a run fast: a forward the plan fuses into its train node runs as its own node here.
A sync-mode run of the real runtime on the local backend gives the same metrics and weights
(tests/runtime/test_serial_reference.py): it is the reference the runtime is held to.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from flowrl.contract import EngineContext, ExecutionPlan, GenerationEngine
from flowrl.errors import PlanError
from flowrl.graph.ir import Generate, Graph
from flowrl.runtime.dispatch import draw_seed
from flowrl.runtime.nodes import NodeRuntime, generate_metrics, node_runtime, run_node
from flowrl.runtime.runstate import PromptStream

if TYPE_CHECKING:
    from flowrl.plugins.manager import Registry


@dataclass
class SerialRun:
    metrics: list[dict[str, Any]]  # per step: "<node>/<metric>" -> value, as a run's metrics.jsonl names them
    trainers: dict[str, Any]  # model -> its training engine, after the last step


def run_serial(
    graph: Graph, plan: ExecutionPlan, registry: Registry | None = None, steps: int | None = None
) -> SerialRun:
    """Run ``steps`` (default: the config's) iterations of ``graph`` as ``plan`` resolved it, serially."""
    from flowrl.plugins.manager import registry as default_registry
    from flowrl.tasks.builtin import task_for

    reg, cfg = registry or default_registry(), plan.config
    _refuse_what_it_does_not_run(graph, plan)
    reg.claim(*(graph.file_functions or ("", ())))  # a graph file's own functions, whichever file was loaded since
    torch.manual_seed(cfg.seed)
    trainers = _training_engines(graph, plan, reg)
    # 7. weight sync: a model generates with its training engine itself, so a train step's weights are the
    # ones the next step samples with (across devices the runtime copies them: flowrl.runtime.weightsync)
    generators = {n.model: trainers[n.model] for n in graph.nodes.values() if isinstance(n, Generate)}
    for model, engine in generators.items():
        if not isinstance(engine, GenerationEngine):
            raise PlanError(
                f"model '{model}': the serial reference loop generates with the training engine, and "
                f"'{plan.model_run(model).training_engine}' does not generate."
            )
    task = task_for(cfg, registry={e.name: e.obj for e in reg.entries("tasks")})
    prompts = PromptStream(task, random.Random(cfg.seed))
    # how forward, reward, compute and train nodes run (flowrl.runtime.nodes); a fused forward runs as its own node
    rt = node_runtime(graph, plan, reg, task, generators, trainers, fused=False)
    records = []
    try:
        for _ in range(cfg.steps if steps is None else steps):
            batch: dict[str, Any] = {"prompts": prompts(cfg.rollout.prompts_per_step)}  # 1. the step's prompts
            record: dict[str, Any] = {}
            for name in graph.order():  # 2.-6. every node once, after the nodes whose keys it reads
                node = graph.nodes[name]
                out, metrics = _generate(rt, node, batch) if isinstance(node, Generate) else run_node(rt, name, batch)
                batch.update(out)
                record.update({f"{name}/{key}": value for key, value in metrics.items()})
            records.append(record)
    finally:
        rt.rewards.close()
    return SerialRun(metrics=records, trainers=trainers)


def _training_engines(graph: Graph, plan: ExecutionPlan, reg: Registry) -> dict[str, Any]:
    """One training engine per model, each built after the model it initialises from (a critic or a
    reference starts from the actor's weights), from a seed of its own: the same initial weights as
    in any run of the plan."""
    engines: dict[str, Any] = {}
    pending = list(graph.models)
    while pending:
        name = next(m for m in pending if graph.models[m].init_from in (None, *engines))
        pending.remove(name)
        decl, spec = graph.models[name], plan.model_run(name)
        torch.manual_seed(spec.seed + zlib.crc32(name.encode()))
        factory = reg.entry("training_engines", spec.training_engine, field="train.engine").obj
        source = engines.get(decl.init_from) if decl.init_from is not None else None
        ctx = EngineContext(
            decl=decl,
            spec=spec,
            device=plan.config.device,
            source=source,
            trust_remote_code=plan.config.trust_remote_code,
        )
        engines[name] = factory(ctx)
    return engines


def _generate(rt: NodeRuntime, node: Generate, batch: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A generate node: its responses with their behaviour log-probs, under the keys it writes."""
    prompts = batch[node.reads[0]]
    engine = rt.generators[node.model]
    # the engine's sampler is seeded from the node's own random stream (the runtime sends a rank that seed)
    sampler = torch.Generator().manual_seed(draw_seed(rt.rng(node.name)))
    out = engine.generate(prompts, n=1 if node.greedy else node.n, greedy=node.greedy, generator=sampler)
    seqs = out.sequences
    # every token knows the version that sampled it: here, one version for the whole batch
    versions = torch.full_like(seqs.response_ids, engine.version) * seqs.response_mask.long()
    seqs = replace(seqs, logprobs=out.logprobs, version=engine.version, versions=versions)
    metrics = {**generate_metrics(prompts, seqs), "tokens": int(seqs.sampled_mask.sum())}
    return dict(zip(node.writes, (seqs, seqs.logprobs))), metrics


def _refuse_what_it_does_not_run(graph: Graph, plan: ExecutionPlan) -> None:
    """The loop is one process, one rank, synchronous rollouts, the training engine sampling, and one
    generation call per node and step."""
    policy = plan.layout.rollout if plan.layout is not None else None
    if policy is not None and (policy.mode != "sync" or policy.partial or policy.streaming):
        raise PlanError(
            f"the serial reference loop runs synchronous rollouts; the plan's rollout policy is '{policy.mode}'"
            f"{' with partial rollouts' if policy.partial else ''}{' streaming' if policy.streaming else ''}. "
            "Plan it with rollout.mode=sync."
        )
    for layout in plan.layout.models if plan.layout is not None else ():
        if layout.parallel.size > 1:
            raise PlanError(
                f"model '{layout.model}': the serial reference loop runs every model on one rank; the plan "
                f"splits it dp {layout.parallel.dp} x tp {layout.parallel.tp} x pp {layout.parallel.pp}. "
                "Plan it for one device (--cluster local)."
            )
    for name, node in graph.nodes.items():
        run = plan.model_run(node.model) if isinstance(node, Generate) else None
        if run is not None and run.generation_engine not in (None, run.training_engine):
            raise PlanError(
                f"node '{name}': the serial reference loop samples with the training engine "
                f"'{run.training_engine}' itself; the plan generates with '{run.generation_engine}'. "
                f"Plan it with generation.engine={run.training_engine}."
            )
        if isinstance(node, Generate) and node.multi_turn:
            raise PlanError(f"node '{name}': the serial reference loop does not run multi-turn environments or agents.")
    filters = sorted(graph.filters().values())
    if filters:
        raise PlanError(f"node '{filters[0]}': the serial reference loop does not run dynamic sampling (filters).")
