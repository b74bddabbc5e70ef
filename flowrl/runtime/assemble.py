"""Assembling a run's parts from a checked plan: the schedule, the workers and their groups, the
node runtime (functions, resolved node options, engines) and one rollout source per generate task.

Everything here comes from the plan as the planner resolved it: node options, micro-batches,
the response budget and the rollout policy are read, never re-derived.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flowrl.contract.layout import RolloutPolicy
from flowrl.contract.plan import ExecutionPlan
from flowrl.graph.ir import Filter, Generate, Graph
from flowrl.runtime.batch import pad_id
from flowrl.runtime.groups import GenerationGroup, TrainingGroup, Transport, publish
from flowrl.runtime.nodes import NodeRuntime, filter_groups, node_runtime, run_node
from flowrl.runtime.rollout import Rounds, StepRollout
from flowrl.runtime.runstate import PromptStream
from flowrl.runtime.schedule import Schedule

if TYPE_CHECKING:
    from flowrl.plugins.manager import Registry


@dataclass
class RunParts:
    """What a run drives: built once, before the first step."""

    schedule: Schedule
    transport: Transport
    trainers: dict[str, TrainingGroup]  # model -> its training group
    generators: dict[str, GenerationGroup]  # model -> its generation group (models that generate)
    rt: NodeRuntime
    sources: dict[str, StepRollout]  # generate task -> its rollouts across steps
    stream: PromptStream
    policy: RolloutPolicy
    prompts_per_step: int

    def publish_all(self) -> None:
        """Every weight sync of the schedule, now (restored weights into the generation replicas)."""
        for t in self.schedule.tasks:
            if t.kind == "sync" and t.model is not None:
                publish(self.trainers[t.model], self.generators[t.model], t.strategy, t.name)

    def prompts(self, step: int) -> list[Any] | None:
        """The prompts step ``step`` is created with (None with partial rollouts: generation draws them)."""
        return None if self.policy.partial else self.stream(self.prompts_per_step)


def assemble(graph: Graph, plan: ExecutionPlan, registry: Registry, schedule: Schedule, launch: Any) -> RunParts:
    """The parts of a run of ``plan``; ``launch(schedule)`` starts the workers and returns the
    transport and each model's (tokenizer, hf_config)."""
    from flowrl.tasks.builtin import task_for

    cfg = plan.config
    task = task_for(cfg, registry={e.name: e.obj for e in registry.entries("tasks")})
    stream = PromptStream(task, random.Random(cfg.seed))
    transport, built = launch(schedule)
    trainers = {
        m.model: TrainingGroup(
            graph.models[m.model],
            schedule.ranks_of(m.model),
            transport,
            *built[m.model],
            tp=plan.layout.layout(m.model).parallel.tp,
        )
        for m in schedule.models
    }
    generators = {
        m.model: GenerationGroup(
            m.model,
            schedule.generation_ranks(m.model),
            transport,
            pad_id(built[m.model][0]),
            tp=plan.layout.generation_of(m.model).tp,
        )
        for m in schedule.models
        if m.generation_group is not None
    }
    rt = node_runtime(graph, plan, registry, task, generators, trainers)
    if graph.sources():  # they tokenize the data's responses as the models do (one base model, one tokenizer)
        model = next(iter(graph.models))
        rt.tokenizer, rt.pad_id = built[model][0], pad_id(built[model][0])
        rt.response_budget = plan.model_run(model).sampling.max_new_tokens
    policy = plan.layout.rollout if plan.layout is not None else RolloutPolicy()
    sources = {
        t.name: _source(graph, plan, graph.nodes[t.name], generators[t.model], policy, stream, built, rt)
        for t in schedule.tasks
        if t.kind == "generate"
    }
    return RunParts(
        schedule, transport, trainers, generators, rt, sources, stream, policy, cfg.rollout.prompts_per_step
    )


def _source(
    graph: Graph,
    plan: ExecutionPlan,
    gen: Any,
    generator: GenerationGroup,
    policy: RolloutPolicy,
    stream: PromptStream,
    built: dict[str, Any],
    rt: NodeRuntime,
) -> StepRollout:
    assert isinstance(gen, Generate)
    cfg = plan.config
    budget = plan.model_run(gen.model).sampling.max_new_tokens
    return StepRollout(
        model=gen.model,
        generator=generator,
        n=1 if gen.greedy else gen.n,
        greedy=gen.greedy,
        policy=policy,
        prompts_per_step=cfg.rollout.prompts_per_step,
        chunk_tokens=policy.chunk_tokens or cfg.rollout.chunk_tokens or policy.chunk(budget),
        stream_groups=cfg.rollout.stream_groups,
        pad_id=pad_id(built[gen.model][0]),
        draw=stream,
        rounds=_rounds(graph, gen, rt, cfg.rollout.prompts_per_step),
        episodes=_episodes(gen, rt, built[gen.model][0], budget),
        agents=_agents(gen, rt, built[gen.model][0], budget),
    )


def _rounds(graph: Graph, gen: Generate, rt: NodeRuntime, prompts_per_step: int) -> Rounds | None:
    """Dynamic sampling for ``gen`` when a filter keeps groups of its rows: each round runs the
    nodes between them, then the filter."""
    name = graph.filters().get(gen.name)
    if name is None:
        return None
    _, between = graph.filter_segment(name)
    node = graph.nodes[name]
    assert isinstance(node, Filter)

    def run(prompts: list[Any], seqs: Any, logprobs: Any) -> tuple[dict[str, Any], Any, dict[str, Any]]:
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

    return Rounds(
        run=run,
        groups=node.groups or prompts_per_step,
        max_rounds=node.max_rounds,
        filter=name,
        rows=node.by_row,
    )


def _episodes(gen: Generate, rt: NodeRuntime, tokenizer: Any, budget: int) -> Any:
    """Multi-turn episodes for a generate node with an environment."""
    if gen.env is None:
        return None
    from flowrl.runtime.episodes import Episodes

    factory = rt.functions["environments"][gen.env]
    _, options = rt.options[gen.name]
    return Episodes.build(gen, factory, rt.task, options, tokenizer, budget, rt.rewards.concurrency)


def _agents(gen: Generate, rt: NodeRuntime, tokenizer: Any, budget: int) -> Any:
    """Agent episodes for a generate node with an agent, served through the run's endpoint."""
    if gen.agent is None:
        return None
    from flowrl import agents
    from flowrl.runtime import agents as rollouts
    from flowrl.runtime.episodes import _tokenizer_template

    registered = not agents.is_reference(gen.agent)
    fn = rt.functions["agents"][gen.agent] if registered else agents.load(gen.agent, gen.name)
    _, options = rt.options[gen.name]
    template = getattr(rt.task, "template", None) or _tokenizer_template(tokenizer)
    return rollouts.build(gen, fn, registered, rt.task, options, tokenizer, template, budget, gen.model)
