"""The ``verifiers`` task: a verifiers (0.4) environment's own taskset as flowrl's prompt stream.

``task: verifiers`` with ``task_options: {environment: ID, env_args: {...}, limit: N}`` turns the tasks of
the environment's taskset (`flowrl.agents.verifiers_env.verifiers_prompts`: an installed environment, or a
``path/to/env.py`` of your own) into prompts, each carrying its task's index (``meta["vf_idx"]``), so the
``verifiers`` agent plays exactly that task. Nothing is downloaded at run time.

- Prompts: each is the task at an index drawn from the run's rng, so the stream is deterministic given the
  seed (the taskset is loaded once per process, in its own order).
- Scoring: the environment's rubric scores an episode inside the agent (``agent="verifiers"``); a graph
  rewards it with ``fn="agent"``. ``fn="task"`` on this task is refused (a TaskError): a response alone,
  outside its episode, has no score here.
- Response budget (``max_new_tokens``): the option when given, else the longest answer of the taskset plus
  one token for EOS when every task has a text answer, else :data:`OPEN_BUDGET`. With ``turns`` > 1 on the
  agent's node it is the budget of the whole episode (the model's turns and the messages between them).

The agent's options must load the same environment: pass the same ``environment``, ``env_args`` and
``limit`` to both (the example graph ``graphs/verifiers_env.py`` reads them from ``task_options``).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any, ClassVar

import msgspec

from flowrl.contract.data import Prompt
from flowrl.errors import AgentError, TaskError
from flowrl.specs import Spec

NAME = "verifiers"
#: the response budget of an environment whose tasks have no text answer to size it by
OPEN_BUDGET = 64


class VerifiersOptions(Spec):
    """The ``verifiers`` task's options (``task_options``)."""

    environment: str | None = None  # an installed verifiers environment, or path/to/env.py (required)
    env_args: dict[str, Any] = {}  # the taskset's config fields (its TasksetConfig)
    limit: int | None = None  # take only the first N tasks (required for an infinite taskset)
    max_new_tokens: int | None = None  # None: the longest answer + EOS (OPEN_BUDGET without answers)


class VerifiersTask:
    """A verifiers environment's taskset as flowrl prompts, scored by its rubric inside the agent."""

    name: ClassVar[str] = NAME
    description: ClassVar[str] = (
        "a verifiers environment's own tasks (task_options environment=ID or file.py, env_args, limit), played "
        "by agent='verifiers' and rewarded with fn='agent' (pip install 'flowrl[verifiers]')"
    )

    def __init__(self, options: VerifiersOptions) -> None:
        if not options.environment:
            raise TaskError(
                f"task '{NAME}': option 'environment' names no verifiers environment; give an installed one "
                "(environment: gsm8k) or a file of your own (environment: path/to/env.py)."
            )
        from flowrl.agents.verifiers_env import verifiers_prompts

        self.options = options
        try:
            self.tasks = verifiers_prompts(options.environment, options.env_args, options.limit)
        except AgentError as exc:
            raise TaskError(f"task '{NAME}': {exc}") from None
        if options.max_new_tokens is not None:
            if options.max_new_tokens < 1:
                raise TaskError(
                    f"task '{NAME}': option 'max_new_tokens' must be at least 1, got {options.max_new_tokens}"
                )
            self._budget = options.max_new_tokens
        elif all(p.answer for p in self.tasks):
            self._budget = max(len(p.answer) for p in self.tasks) + 1
        else:
            self._budget = OPEN_BUDGET

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> VerifiersTask:
        if not isinstance(options, Mapping):
            raise TaskError(f"task '{NAME}': options must be a mapping, got {type(options).__name__}")
        try:
            parsed = msgspec.convert(dict(options), VerifiersOptions)
        except msgspec.ValidationError as exc:
            fields = ", ".join(VerifiersOptions.__struct_fields__)
            raise TaskError(f"task '{NAME}': bad option: {str(exc).replace('`$.', '`')} (options: {fields})") from None
        return cls(parsed)

    @classmethod
    def from_config(cls, cfg: Any) -> VerifiersTask:
        """The task of run config ``cfg`` (its ``task_options``)."""
        return cls.from_options(cfg.task_options)

    # ------------------------------------------------------------ the Task protocol
    def max_new_tokens(self) -> int:
        return self._budget

    def prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        """``n`` of the environment's tasks at indices drawn with ``rng`` (deterministic given its state)."""
        if n < 0:
            raise TaskError(f"task '{NAME}': cannot draw a negative number of prompts ({n})")
        return [self.tasks[rng.randrange(len(self.tasks))] for _ in range(n)]

    def score(self, prompt: Prompt, response: str) -> float:
        raise TaskError(
            f"task '{NAME}' (environment {self.options.environment!r}): its rubric scores an episode inside the "
            "agent, not a response alone; play it with agent='verifiers' and reward it with fn='agent', not "
            "fn='task' (evaluation, which scores by the task, is not available either)."
        )
