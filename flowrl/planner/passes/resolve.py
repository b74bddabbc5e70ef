"""The ``resolve`` pass. Reads the graph, the registry and the plan's config and target; writes the
resolved config (response budget, loss_norm), the target's per-role models, workload and memory
numerics, each node's options, each model's run (`ModelRun`) and the fused forwards. Fails with
the node, key or field at fault when a task, function, loss, engine or option does not exist or fit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from flowrl.contract.plan import ExecutionPlan
from flowrl.contract.resolved import NodeOptions
from flowrl.contract.workload import WorkloadSpec
from flowrl.errors import PlanError
from flowrl.graph.ir import Compute, Filter, Generate, Reward, Source, Train
from flowrl.planner.modelspec import role_models
from flowrl.planner.passes.lengths import episode_lengths, task_lengths
from flowrl.planner.passes.numerics import engine_memory, resolve_numerics
from flowrl.planner.passes.options import agent_function, node_plan_options
from flowrl.planner.passes.ports import check_keys, check_unused, inputs_only
from flowrl.planner.passes.rows import node_rows
from flowrl.planner.passes.runs import fused_forwards, model_runs
from flowrl.specs import AGGREGATES, AUTO, RunConfig

if TYPE_CHECKING:
    from flowrl.graph import Graph
    from flowrl.planner.passes.context import PlanContext


def resolve(ctx: PlanContext, plan: ExecutionPlan) -> ExecutionPlan:
    """Check every task, function, loss, engine and node option the plan names.

    Fills the response budget from the task and, unless one was given, the workload from the config."""
    from flowrl.tasks.builtin import task_for

    reg, graph, cfg = ctx.registry, ctx.graph, plan.config
    task = task_for(cfg, registry={e.name: e.obj for e in reg.entries("tasks")})
    check_source_columns(graph, cfg, task)
    budget = cfg.rollout.max_new_tokens if cfg.rollout.max_new_tokens is not None else task.max_new_tokens()
    cfg = msgspec.structs.replace(cfg, rollout=msgspec.structs.replace(cfg.rollout, max_new_tokens=budget))
    if cfg.algo.loss_norm is None:  # Dr. GRPO's constant (seq-mean-token-sum-norm): the response budget
        cfg = msgspec.structs.replace(cfg, algo=msgspec.structs.replace(cfg.algo, loss_norm=budget))
    rows = node_rows(graph, cfg.rollout.prompts_per_step)
    seqs = graph.sequence_keys()
    resolved: dict[str, NodeOptions] = {}
    for node in graph.nodes.values():
        if isinstance(node, Reward):
            reg.entry("reward_functions", node.fn)
        elif isinstance(node, Compute):
            entry = reg.entry("compute_functions", node.fn)
            check_keys(node, f"compute function '{node.fn}'", entry.meta, seqs, node.updates)
        elif isinstance(node, Filter):
            entry = reg.entry("filters", node.fn)
            check_keys(node, f"filter function '{node.fn}'", inputs_only(entry.meta), seqs)
        elif isinstance(node, Generate) and node.env is not None:
            reg.entry("environments", node.env)
        elif isinstance(node, Generate) and node.agent is not None:
            agent_function(reg, node)
        elif isinstance(node, Train):
            entry = reg.entry("losses", node.loss)
            check_keys(node, f"loss '{node.loss}'", inputs_only(entry.meta), seqs)
            check_unused(node, f"loss '{node.loss}'", entry.meta, seqs)
            decl = graph.models[node.model]
            want = ("values", "scores") if decl.scalar_head else ("logprobs",)
            if entry.meta.get("output", "logprobs") not in want:
                raise PlanError(
                    f"node '{node.name}': loss '{node.loss}' trains on {entry.meta.get('output')}, but model "
                    f"'{decl.name}' (role {decl.role}) produces {' or '.join(want)}."
                )
            if entry.meta.get("rows", "each") == "pairs":
                check_pairs(graph, node, f"loss '{node.loss}'")
            if entry.meta.get("aggregate", "token-mean") not in AGGREGATES:
                raise PlanError(
                    f"node '{node.name}': loss '{node.loss}' is registered with aggregate="
                    f"{entry.meta.get('aggregate')!r}; valid: {', '.join(AGGREGATES)} (what the loss is a mean over)."
                )
        resolved[node.name] = node_plan_options(graph, node.name, cfg, reg)
        if isinstance(node, Train):
            mini_batches = resolved[node.name].options["mini_batches"]
            where = (
                "the node's mini_batches option"
                if "mini_batches" in {**node.options, **cfg.nodes.get(node.name, {})}
                else "train.mini_batches"
            )
            if mini_batches > rows[node.name]:
                raise PlanError(
                    f"node '{node.name}': {mini_batches} mini-batches but only {rows[node.name]} rows per "
                    f"step; lower {where}."
                )
    for kind, name, field_ in (
        ("executors", cfg.executor, "executor"),
        ("generation_engines", cfg.generation.engine, "generation.engine"),
        ("training_engines", cfg.train.engine, "train.engine"),
    ):
        if name != AUTO:  # an 'auto' generation engine is chosen by `place`
            reg.entry(kind, name, field=field_)
    target = plan.target
    if target.models:  # per-role models: every graph model's own shape, the first actor's as the base
        models = role_models(target.models, {m: d.role for m, d in graph.models.items()})
        first = next(m for m, d in graph.models.items() if d.role == "actor") if graph.models else None
        target = msgspec.structs.replace(target, models=models, model=models.get(first or "", target.model))
    if target.workload is None:
        prompt_length, lengths = task_lengths(task, cfg.rollout.max_new_tokens, cfg.rollout.ignore_eos)
        turns = max((n.turns for n in graph.nodes.values() if isinstance(n, Generate) and n.multi_turn), default=1)
        if turns > 1:
            lengths = episode_lengths(graph, lengths, budget, cfg.rollout.ignore_eos)
        generates = any(isinstance(n, Generate) for n in graph.nodes.values())
        samples = cfg.rollout.samples_per_prompt if generates else 1  # a source reads each prompt's rows once
        workload = WorkloadSpec(
            turns=turns,
            prompts_per_step=cfg.rollout.prompts_per_step,
            samples_per_prompt=samples,
            prompt_length=prompt_length,
            response_length=lengths,
            ppo_epochs=cfg.train.epochs,
            mini_batches=min(cfg.train.mini_batches, cfg.rollout.prompts_per_step * samples),
        )
        target = msgspec.structs.replace(target, workload=workload)
    largest = max([target.spec(m).parameters() for m in graph.models] or [target.model.parameters()])
    numerics = resolve_numerics(cfg.train, target.cluster.hardware, largest)
    if target.capabilities is not None:  # a plan for an executor: its memory as the engine computes
        target = msgspec.structs.replace(target, numerics=engine_memory(target.numerics, numerics))
    runs = model_runs(graph, cfg, budget, numerics)
    fused = fused_forwards(graph, resolved, reg, cfg.train.engine)
    return msgspec.structs.replace(plan, config=cfg, target=target, options=resolved, models=runs, fused=fused)


#: The rollout settings that only change how responses are generated (not the response budget,
#: max_new_tokens, nor the prompts per step, which a train-only graph reads too).
GENERATION_SETTINGS = (
    "samples_per_prompt", "temperature", "top_p", "ignore_eos", "stop", "mode", "staleness", "overprovision",
    "chunk_tokens", "stream_groups",
)  # fmt: skip


def unused_generation_settings(graph: Graph, cfg: RunConfig) -> list[str]:
    """Warnings for a graph that generates nothing (its responses read from the data by a source node):
    each generation setting changed from its default, which it ignores."""
    if any(isinstance(n, Generate) for n in graph.nodes.values()):
        return []
    from flowrl.specs import RolloutConfig

    default = RolloutConfig()
    changed = [k for k in GENERATION_SETTINGS if getattr(cfg.rollout, k) != getattr(default, k)]
    if not changed:
        return []
    sources = [n.name for n in graph.nodes.values() if isinstance(n, Source)]
    where = f" (source node '{sources[0]}' reads its responses from the data)" if sources else ""
    settings = ", ".join(f"rollout.{k}={getattr(cfg.rollout, k)!r}" for k in changed)
    return [
        f"graph '{graph.name}' generates nothing{where}, so {settings} has no effect. The rollout settings a "
        "train-only graph reads are prompts_per_step (rows per step) and max_new_tokens (the response budget)."
    ]


def check_source_columns(graph: Graph, cfg: RunConfig, task: object) -> None:
    """A source node over the user's files gets the rows it reads: a preference pair per prompt
    (data.chosen_key and data.rejected_key) for ``rows="pairs"``, one response for ``rows="sft"``;
    refused here, before any model is built, not at the first step."""
    from flowrl.specs import DATA_TASK

    if getattr(task, "name", None) != DATA_TASK:
        return
    pairs = cfg.data.chosen_key is not None
    for node in graph.nodes.values():
        if not isinstance(node, Source) or (node.rows == "pairs") == pairs:
            continue
        if node.rows == "pairs":
            raise PlanError(
                f"node '{node.name}' (rows=pairs) reads a chosen and a rejected response per prompt, and the data "
                "gives one (data.chosen_key is not set): name the columns with --set data.chosen_key=COLUMN "
                "data.rejected_key=COLUMN (and data.response_key=null)."
            )
        raise PlanError(
            f"node '{node.name}' (rows={node.rows}) reads one response per prompt, and the data gives preference "
            f"pairs (data.chosen_key={cfg.data.chosen_key!r}): name the response column with --set "
            "data.response_key=COLUMN data.chosen_key=null data.rejected_key=null, or train on the pairs with "
            "graphs/dpo.py."
        )


def check_pairs(graph: Graph, node: Train, what: str) -> None:
    """A loss that reads rows in pairs (registered with ``rows="pairs"``: row ``2i`` chosen, ``2i+1``
    rejected) trains on the rows of a source node that writes them so (``rows="pairs"``), read unfiltered."""
    seqs = graph.sequence_keys()
    producers = graph.producers()
    for key in node.reads:
        if key not in seqs:
            continue
        writer = graph.nodes[producers[key][0]] if producers.get(key) else None
        if not (isinstance(writer, Source) and writer.rows == "pairs"):
            got = f"node '{writer.name}' ({writer.kind})" if writer is not None else "the graph's inputs"
            raise PlanError(
                f"node '{node.name}': {what} reads rows in pairs (a chosen and a rejected response), but its key "
                f"'{key}' comes from {got}; read it from a source node with rows='pairs' (g.source(..., rows='pairs'))."
            )
