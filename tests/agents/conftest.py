"""The agent tests' engine, built once a module; their helpers are in agent_play.py (this folder on sys.path)."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from flowrl import api  # noqa: E402
from flowrl.plugins.manager import registry  # noqa: E402
from flowrl.runtime.executor import PlanExecutor  # noqa: E402


@pytest.fixture(scope="module")
def actor() -> Any:
    """The tiny default model's generation engine (the one a `flowrl run` of grpo uses)."""
    graph, plan = api.plan("grpo", overrides=[], emit=lambda s: None)
    trainers, _ = PlanExecutor(registry()).engines(graph, plan)
    return trainers["actor"]
