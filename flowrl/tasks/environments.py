"""Environments for multi-turn rollouts: what answers the model between its turns.

An environment is registered as a factory ``factory(task, **options)`` (hook
``register_environments``; the generate node's environment options are its options). The object
it returns has:

- ``episode(prompt)``: a new episode's state, one per response, whose ``step(turn)`` (a `Turn`: the
  model's text and the tool calls parsed from it; may be ``async def``) returns a `Step`: text to
  write into the response, or tool results (rendered by the chat template), a turn reward, and
  whether the episode is done (a final reply and ``done`` together are fine);
- optionally ``tools``: JSON schemas (as ``transformers.utils.get_json_schema`` makes them), given to
  the chat template with the prompt (``apply_chat_template(tools=...)``).

The simpler ``reply(prompt, turns)`` (the model's turn texts so far in, text or None out: None ends
the episode) is still understood. What the environment writes is part of the response the model
reads, but not trained on. `flowrl.tasks.tools.ToolEnvironment` makes one from Python functions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgspec

from flowrl.contract.data import Prompt, Turn
from flowrl.errors import TaskError


class Step(msgspec.Struct, frozen=True, kw_only=True):
    """An environment's answer to a model turn: ``text`` written into the response as it is, or
    ``tool_results`` (one per tool call, rendered as the chat template writes ``role: tool``
    messages); ``reward`` for the turn; ``done`` ends the episode after what it wrote."""

    text: str | None = None
    tool_results: tuple[str, ...] = ()
    reward: float = 0.0
    done: bool = False


class ReplyEpisode:
    """An episode of an environment with ``reply(prompt, turns)``: text continues, None ends."""

    def __init__(self, env: Any, prompt: Prompt) -> None:
        self.env, self.prompt, self.turns = env, prompt, []

    def step(self, turn: Turn) -> Step:
        self.turns.append(turn.text)
        reply = self.env.reply(self.prompt, list(self.turns))
        if reply is not None and not isinstance(reply, str):
            raise TypeError(f"reply() returned {type(reply).__name__}; a reply is text (or None to end the episode)")
        return Step(text=reply, done=reply is None)


_PRODUCT = re.compile(r"^\s*(\d+)\s*([*+-])\s*(\d+)\s*:?\s*$")


@dataclass(frozen=True)
class Calculator:
    """A calculator holding the prompt's expression (``"37*58:"``): a model turn that starts with
    the key ``=`` gets the result and ``|`` (``"2146|"``); any other turn is the model's final
    answer and ends the episode, as does the turn after a result."""

    key: str = "="

    def reply(self, prompt: Prompt, turns: list[str]) -> str | None:
        if len(turns) > 1 or not turns[-1].startswith(self.key):
            return None
        match = _PRODUCT.match(prompt.text)
        if match is None:
            return "error|"
        a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
        value = a * b if op == "*" else a + b if op == "+" else a - b
        return f"{value}|"


def calculator(task: Any, *, key: str = "=") -> Calculator:
    """A calculator tool: the turn ``=`` gets the value of the prompt's arithmetic, then ``|``."""
    if not isinstance(key, str) or not key:
        raise TaskError(f"environment 'calculator': key must be a non-empty string, got {key!r}.")
    return Calculator(key=key)


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return int(a) * int(b)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first term
        b: the second term
    """
    return int(a) + int(b)


def arithmetic(task: Any, *, penalty: float = 0.0) -> Any:
    """Tools in the chat template's format: ``multiply(a, b)`` and ``add(a, b)``; a turn without a
    tool call is the final answer. ``penalty``: the turn reward of a malformed or failing call."""
    from flowrl.tasks.tools import ToolEnvironment

    return ToolEnvironment([multiply, add], penalty=penalty)


ENVIRONMENTS: dict[str, Any] = {"calculator": calculator, "arithmetic": arithmetic}
