"""Agents: the user's code that plays episodes against the policy in training, over the OpenAI API.

A generate node with ``agent=`` (`flowrl.graph.Graph.generate`) runs an agent ``n`` times per prompt.
The agent is one of

- a registered agent (hook ``register_agents``: ``factory(task, **options)`` returns the callable;
  built-in: ``command``, ``verifiers``, ``openenv``);
- ``"package.module:function"`` or ``"path/to/file.py:function"``: a plain callable, sync or
  ``async def``, which is handed the node's options with its other arguments.

It is called once per episode with the keyword arguments its signature names (`ARGUMENTS`; a
``**kwargs`` parameter gets them all): above all ``base_url`` and ``api_key`` for an ``openai``
client, whose requests the run serves with the policy (`flowrl.runtime.endpoint`) and records token
by token (`flowrl.runtime.agents`). It returns the episode's reward: a number, a dict with a
``"reward"`` number, or None (the graph's reward node scores the episode).

Agents for ecosystem environments: `flowrl.agents.verifiers_env` (``verifiers`` environments, extra
``flowrl[verifiers]``), `flowrl.agents.openenv_env` (OpenEnv environments, ``flowrl[openenv]``),
`flowrl.agents.command` (any program). The packages are imported only when a factory runs
(`flowrl.agents.imports`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from flowrl.errors import GraphError

#: what an agent may ask for by name: the episode's endpoint and the task's prompt
ARGUMENTS = {
    "base_url": "the episode's OpenAI base URL (http://127.0.0.1:PORT/episodes/ID/v1)",
    "api_key": "the run's key for that endpoint",
    "model": "the served model's name (the graph model)",
    "episode_id": "the episode's id",
    "messages": "the prompt as chat messages (a user message for a plain-text prompt)",
    "prompt": "the prompt's text",
    "answer": "the task's reference answer",
    "meta": "the prompt's other fields (a dataset row's other columns)",
}


def is_reference(name: str) -> bool:
    """Whether an agent name is a ``module:attr`` / ``file.py:attr`` reference (not a registered name)."""
    return ":" in name


def load(reference: str, node: str) -> Callable[..., Any]:
    """The callable ``reference`` (``module:attr`` or ``file.py:attr``) names; a GraphError naming the
    node and the reference when it cannot be loaded or is not callable."""
    from flowrl.agents.imports import load_object
    from flowrl.errors import AgentError

    try:
        fn = load_object(reference, f"node '{node}': agent")
    except AgentError as exc:
        raise GraphError(str(exc)) from None
    if not callable(fn):
        raise GraphError(f"node '{node}': agent '{reference}' is a {type(fn).__name__}, not a callable.")
    return fn


def accepted(fn: Callable[..., Any]) -> tuple[frozenset[str], bool]:
    """The keyword names ``fn`` takes, and whether it takes ``**kwargs``."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return frozenset(), True
    names = frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    return names, any(p.kind is p.VAR_KEYWORD for p in params)


def arguments(fn: Callable[..., Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of ``given`` that ``fn`` names (all of them for ``**kwargs``)."""
    names, anything = accepted(fn)
    return dict(given) if anything else {k: v for k, v in given.items() if k in names}


def is_async(fn: Callable[..., Any]) -> bool:
    call = getattr(fn, "__call__", None)  # noqa: B004 - an object with an async __call__
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call)


def reward_of(value: Any) -> float | None:
    """An agent's return value as a reward (None: none given); a TypeError for anything else."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        if "reward" not in value:
            raise TypeError(f"returned a dict without 'reward' (keys: {', '.join(map(str, value))})")
        value = value["reward"]
        if value is None:
            return None
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)) and not isinstance(value, complex):
        reward = float(value)
        if reward != reward or reward in (float("inf"), float("-inf")):
            raise TypeError(f"returned the reward {value!r}, which is not finite")
        return reward
    raise TypeError(f"returned {type(value).__name__}; an agent returns a number, {{'reward': number}} or None")
