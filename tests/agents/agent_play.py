"""What the agent tests share (``from agent_play import ...``: tests/agents/conftest.py puts this folder on
sys.path): agent rollouts over the tiny default model (character tokenizer, no chat template:
`flowrl.runtime.agents.PLAIN_TEMPLATE`), episodes played whole."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from flowrl.contract.data import Prompt
from flowrl.runtime.agents import PLAIN_TEMPLATE, AgentRollouts

PROMPTS = [Prompt(text="12*34:", answer="408"), Prompt(text="5*6:", answer="30")]


def rollouts(actor: Any, agent: Callable[..., Any], **settings: Any) -> AgentRollouts:
    """A generate node's agent rollouts (budget 64 tokens, 4 turns of 16, 30 s timeout unless given)."""
    base: dict[str, Any] = dict(
        node="episodes", model="actor", agent=agent, agent_name=getattr(agent, "__name__", "agent"), options={},
        tokenizer=actor.tokenizer, template=PLAIN_TEMPLATE, budget=64, turns=4, turn_tokens=16, timeout=30.0,
        concurrency=8, failure_reward=-1.0,
    )  # fmt: skip
    base.update(settings)
    return AgentRollouts(**base)


def play(
    actor: Any,
    agent: Callable[..., Any],
    prompts: Sequence[Prompt] = PROMPTS[:1],
    n: int = 1,
    seed: int = 0,
    **settings: Any,
) -> tuple[Any, dict[str, float]]:
    """``n`` episodes of ``agent`` per prompt, played whole: their Sequences and the node's metrics."""
    agents = rollouts(actor, agent, **settings)
    try:
        seqs = agents.run(actor, prompts, n, torch.Generator().manual_seed(seed), actor.version)
        metrics = agents.take_metrics(seqs)
    finally:
        agents.close()
    return seqs, metrics


def rewards(seqs: Any) -> list[float]:
    return [sum(t.reward for t in e) for e in seqs.episodes]


def trajectory(seqs: Any, i: int = 0) -> tuple[list[int], list[int], list[float]]:
    """Row ``i``'s prompt ids, response ids and action mask (what training sees)."""
    prompt = seqs.prompt_ids[i][seqs.prompt_mask[i].bool()].tolist()
    n = int(seqs.response_mask[i].sum())
    return prompt, seqs.response_ids[i, :n].tolist(), seqs.action_mask[i, :n].tolist()


def our_threads(wait_s: float = 15.0) -> list[str]:
    """The names of the live threads the endpoint and the agent loop run in, once they had ``wait_s`` to
    end (a cancelled agent's loop finishes shutting down after the rollout returned; a loaded box is slow)."""
    deadline = time.monotonic() + wait_s
    while True:
        names = [t.name for t in threading.enumerate() if t.name in ("flowrl-endpoint", "flowrl-agents")]
        if not names or time.monotonic() > deadline:
            return names
        time.sleep(0.05)
