"""The prompt and response lengths a task's workload has (single- and multi-turn), for `resolve`
to write the workload when the target does not give one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flowrl.contract.reading import episode_budget
from flowrl.contract.workload import Fixed, Histogram, Lengths, max_length
from flowrl.graph.ir import Generate, Graph

if TYPE_CHECKING:
    pass


def task_lengths(task: Any, budget: int, ignore_eos: bool) -> tuple[int, Lengths]:
    """The prompt length (tokens, with BOS) and response lengths a policy that solves ``task``
    produces: its answers plus EOS, capped at the budget, as a histogram over 2000 drawn prompts
    (the budget itself when EOS is ignored)."""
    import random
    from collections import Counter

    if hasattr(task, "prompt_tokens"):  # a dataset: its prompts' token counts; responses as long as allowed
        return task.prompt_tokens(), Fixed(value=budget)
    drawn = task.prompts(random.Random(0), 2000)
    prompt = max(len(p.text) for p in drawn) + 1
    if ignore_eos:
        return prompt, Fixed(value=budget)
    counts = Counter(min(len(p.answer) + 1, budget) for p in drawn)
    return prompt, Histogram(lengths=sorted(counts), weights=[float(counts[k]) for k in sorted(counts)])


def episode_lengths(graph: Graph, answer: Lengths, budget: int, ignore_eos: bool) -> Lengths:
    """The response lengths of a graph's multi-turn episodes: each of its ``turns`` model turns about
    an answer long (at most ``turn_tokens``) and, between turns, environment text about as long again
    (at most ``env_tokens`` in all), within the episode's budget; the whole budget when EOS is ignored."""
    node = max((n for n in graph.nodes.values() if isinstance(n, Generate) and n.multi_turn), key=lambda n: n.turns)
    cap = episode_budget(graph, node.model, budget)
    if ignore_eos:
        return Fixed(value=cap)
    values, weights = (
        (answer.lengths, answer.weights) if isinstance(answer, Histogram) else ([max_length(answer)], [1.0])
    )
    out: dict[int, float] = {}
    for length, weight in zip(values, weights):
        turn = min(length, node.turn_tokens or length)
        env = min((node.turns - 1) * length, node.env_tokens if node.env_tokens is not None else cap)
        total = min(node.turns * turn + env, cap)
        out[total] = out.get(total, 0.0) + weight
    return Histogram(lengths=sorted(out), weights=[out[k] for k in sorted(out)])
