"""The whole-run tests' one way to run a shipped graph: seed 0, no progress bar, in the test's folder."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from flowrl import api


@pytest.fixture
def train(tmp_path) -> Callable[..., api.RunResult]:
    """``train(graph, steps, *overrides)``: plan and run ``graph`` for ``steps`` steps, seed 0."""

    def run(graph: str, steps: int, *extra: str):
        overrides = [f"steps={steps}", "seed=0", "progress=false", f"out={tmp_path}", *extra]
        g, plan = api.plan(graph, overrides=overrides, emit=lambda s: None)
        return api.run(g, plan)

    return run
