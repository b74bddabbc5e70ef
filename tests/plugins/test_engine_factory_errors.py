"""An engine factory's failure is a flowrl error naming the engine, its plugin and the model, as a
node function's failure names the node: e.g. a plugin written against the earlier engine API, which
reads ``ctx.plan`` (engines receive `EngineContext.spec`, never the plan)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from flowrl import api
from flowrl.errors import FlowRLError
from flowrl.plugins.hookspecs import hookimpl
from flowrl.plugins.manager import load_plugins
from flowrl.runtime.executor import run_dir


class EngineWrittenForTheOldContext:
    @hookimpl
    def register_generation_engines(self, register: Any) -> None:
        def factory(ctx: Any) -> Any:
            temperature = ctx.plan.config.rollout.temperature  # the earlier engine API
            raise AssertionError(f"unreachable ({temperature})")

        register("old_gen", factory)


SMALL = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "progress=false", "checkpoint=false"]


def test_an_engine_reading_ctx_plan_fails_naming_the_engine_and_its_plugin(tmp_path: Path) -> None:
    reg = load_plugins(entry_points=False, extra=[("old-engine-plugin", EngineWrittenForTheOldContext())])[1]
    overrides = [*SMALL, "generation.engine=old_gen"]
    graph, plan = api.plan("grpo", registry=reg, overrides=overrides, flags={"steps": 1}, emit=lambda s: None)
    with pytest.raises(FlowRLError) as failed:
        api.run(graph, plan, registry=reg, out_dir=run_dir(str(tmp_path), "run"))
    message = str(failed.value)
    assert "old_gen" in message and "old-engine-plugin" in message and "plan" in message, message
