"""The ``openenv`` task: a stream of episode seeds for OpenEnv environments.

An OpenEnv environment draws its own episode at ``reset()``; the policy sees the environment's observations,
never a flowrl prompt. So this task's prompts are only seeds: each is ``"seed K"`` with ``meta["seed"] = K``,
K drawn from the run's rng in ``[0, seeds)``, which the ``openenv`` agent passes to ``reset(seed=K)``. The
stream is deterministic given the run's seed, and the ``n`` episodes of one prompt (a GRPO group) play the
same episode of a seeded environment, so the group's baseline compares replies to the same observation.

The environment's rewards score an episode inside the agent (``agent="openenv"``); a graph rewards it with
``fn="agent"``. ``fn="task"`` on this task is refused (a TaskError).
"""

from __future__ import annotations

import random
from typing import ClassVar

import msgspec

from flowrl.contract.data import Prompt
from flowrl.errors import TaskError
from flowrl.tasks.builtin import TaskBase

NAME = "openenv"


class OpenEnvSeeds(TaskBase, frozen=True, kw_only=True):
    """Seeds for an OpenEnv environment's ``reset()``: ``"seed K"`` with ``meta["seed"] = K``."""

    name: ClassVar[str] = NAME
    description: ClassVar[str] = (
        "episode seeds for agent='openenv' (the environment draws each episode at reset(seed)); rewarded with "
        "fn='agent'"
    )

    seeds: int = 1_000_000  # seeds are drawn from [0, seeds): how many distinct episodes the run may see
    # option max_new_tokens: the response budget of an episode (its model turns and the observations between)
    budget: int = msgspec.field(default=32, name="max_new_tokens")
    # option prompt_tokens: the longest first observation, in tokens (what the planner sizes prompts by)
    first_tokens: int = msgspec.field(default=32, name="prompt_tokens")

    def __post_init__(self) -> None:
        values = {"seeds": self.seeds, "max_new_tokens": self.budget, "prompt_tokens": self.first_tokens}
        for option, value in values.items():
            if value < 1:
                raise TaskError(f"task '{NAME}': option {option!r} must be at least 1, got {value!r}")

    def max_new_tokens(self) -> int:
        return self.budget

    def prompt_tokens(self) -> int:
        return self.first_tokens

    def sample(self, rng: random.Random) -> Prompt:
        seed = rng.randrange(self.seeds)
        return Prompt(text=f"seed {seed}", answer="", meta={"seed": seed})

    def score(self, prompt: Prompt, response: str) -> float:
        raise TaskError(
            f"task '{NAME}': its prompts are seeds of an OpenEnv environment's episodes, which the environment "
            "rewards inside the agent; play them with agent='openenv' and reward them with fn='agent', not fn='task'."
        )
