"""An OpenEnv (openenv-core 0.3) environment a tiny model can learn: say the word it asks for.

``reset()`` draws a short word of letters and asks ``say: cab``; ``step(EchoAction(text=...))`` ends the
episode with reward 1.0 for the exact word, else the fraction of matching positions. Serve it with OpenEnv
(``create_fastapi_app(EchoEnvironment, EchoAction, EchoObservation)``) or let flowrl's ``openenv`` agent
launch it in-process: ``agent="openenv", environment="examples/environments/openenv_echo.py:EchoEnvironment"``.
"""

from __future__ import annotations

import random
import uuid
from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

LETTERS = "abcd"


class EchoAction(Action):
    text: str


class EchoObservation(Observation):
    prompt: str = ""


class EchoEnvironment(Environment[EchoAction, EchoObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, max_len: int = 3) -> None:
        super().__init__()
        self.max_len = max_len
        self._state = State()
        self._word = ""

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> EchoObservation:
        rng = random.Random(seed)
        self._word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(1, self.max_len)))
        self._state = State(episode_id=episode_id or uuid.uuid4().hex, step_count=0)
        return EchoObservation(prompt=f"say: {self._word}")

    def step(self, action: EchoAction, timeout_s: float | None = None, **kwargs: Any) -> EchoObservation:
        self._state.step_count += 1
        said = action.text.strip()
        if said == self._word:
            reward = 1.0
        else:
            reward = 0.9 * sum(a == b for a, b in zip(self._word, said)) / max(len(self._word), len(said), 1)
        return EchoObservation(prompt="", done=True, reward=reward)

    @property
    def state(self) -> State:
        return self._state
