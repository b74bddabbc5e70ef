"""Environments for multi-turn rollouts: what answers the model between its turns.

An environment is registered as a factory ``factory(task, **options)`` (hook
``register_environments``; the generate node's options are its options). The object it returns
answers ``reply(prompt, turns)``: given the prompt and the model's turns so far (their texts), the
text the environment writes into the response before the model's next turn, or None to end the
episode. What the environment writes is part of the response the model reads, but not trained on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from flowrl.data import Prompt
from flowrl.errors import TaskError

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


ENVIRONMENTS: dict[str, Any] = {"calculator": calculator}
