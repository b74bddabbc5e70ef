"""A verifiers (0.4) environment a tiny model can learn: reverse a short string of letters.

Its taskset builds every task in memory (nothing is downloaded); its reward is 1.0 for the exact
reversal, else the fraction of matching positions. Train on it with flowrl's ``verifiers`` agent:
``agent="verifiers", environment="examples/environments/vf_reverse.py"``.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import verifiers.v1 as vf

LETTERS = "abcd"


class ReverseConfig(vf.TasksetConfig):
    count: int = 64
    """How many tasks the taskset holds."""
    max_len: int = 3
    """The longest string to reverse."""
    seed: int = 0


class ReverseData(vf.TaskData):
    answer: str
    """The reversed string."""


class ReverseTask(vf.Task[ReverseData]):
    @vf.reward
    async def reversed_exactly(self, task: ReverseData, trace: vf.Trace) -> float:
        reply = trace.assistant_messages[-1].content if trace.assistant_messages else ""
        reply = reply.strip() if isinstance(reply, str) else ""
        answer = task.answer
        if reply == answer:
            return 1.0
        return 0.9 * sum(a == b for a, b in zip(answer, reply)) / max(len(answer), len(reply), 1)


class ReverseTaskset(vf.Taskset[ReverseTask, ReverseConfig]):
    def load(self) -> Iterator[ReverseTask]:
        rng = random.Random(self.config.seed)
        for _ in range(self.config.count):
            text = "".join(rng.choice(LETTERS) for _ in range(rng.randint(1, self.config.max_len)))
            yield ReverseTask(ReverseData(prompt=f"reverse: {text}", answer=text[::-1]), self.config.task)


__all__ = ["ReverseTaskset"]
