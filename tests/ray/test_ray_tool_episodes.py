"""Tool-calling episodes on the Ray backend in partial+async rollouts: the driver runs each row's
environment episode between decode chunks while the generation replica (the local engine, then a
vLLM engine) samples on a worker, and rows carry their episodes from step to step.

The model is `tool_model` (tests/conftest.py): a tiny chat model taught to call ``mul``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("ray")

from flowrl import api  # noqa: E402

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.slow]

_HERE = Path(__file__).parents[1] / "runtime" / "test_tool_episodes.py"
_spec = importlib.util.spec_from_file_location("tool_episodes", _HERE)
episodes_tests = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(episodes_tests)


def _run(tool_model, tmp_path, *extra):
    overrides = episodes_tests.overrides(
        tool_model, tmp_path / "runs", "backend=ray", "device=cpu", "rollout.mode=partial+async",
        "rollout.chunk_tokens=32", *extra,
    )  # fmt: skip
    src = episodes_tests.graph_file(tmp_path)
    _, cfg = api.load(src, overrides=overrides)
    from flowrl.plugins.manager import registry

    target = api.local_target(cfg, registry(), devices=2)
    graph, plan = api.plan(
        src, overrides=overrides, target=target, for_backend=True, flags={"steps": 3},
        options={"placement": "disaggregated"}, emit=lambda s: None,
    )  # fmt: skip
    assert plan.layout.placement == "disaggregated"
    engine = "vllm" if "generation.engine=vllm" in extra else "local"
    assert plan.models["actor"].generation_engine == engine
    assert plan.layout.rollout.partial and plan.layout.rollout.mode == "async"
    return api.run(graph, plan).metrics


def _check(m):
    assert len(m) == 3
    assert all(r["episodes/tool_calls"] > 0 for r in m), [r["episodes/tool_calls"] for r in m]
    assert max(r["reward"] for r in m) > 0  # call, its result rendered by the template, a second turn
    assert all(r["episodes/turns"] > 1 for r in m)
    assert max(r["episodes/carried"] for r in m[1:]) > 0  # unfinished episodes carried to the next step
    assert all(r["episodes/staleness_max"] <= 2 for r in m)


def test_tool_episodes_run_partial_async_on_ray(tool_model, tmp_path):
    _check(_run(tool_model, tmp_path))


def test_tool_episodes_run_partial_async_on_ray_with_the_vllm_engine(tool_model, tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    monkeypatch.setenv("FLOWRL_PLUGINS", "ray,vllm")
    _check(_run(tool_model, tmp_path, "generation.engine=vllm"))
