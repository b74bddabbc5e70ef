"""What the serial reference loop (`flowrl.runtime.serial`) cannot run it refuses by name, before any
model is built, rather than running something else; and its agreement with the runtime is a real
check: a runtime that samples with other weights than the loop's (one step stale) disagrees with it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import msgspec
import pytest

from flowrl import api
from flowrl.contract import Parallel
from flowrl.errors import PlanError
from flowrl.plugins.manager import load_plugins
from flowrl.runtime.serial import run_serial

TINY = ["seed=1", "progress=false", "rollout.prompts_per_step=2", "rollout.max_new_tokens=3", "steps=2"]


def _plan(tmp_path: Path, *sets: str, registry=None):
    overrides = [*TINY, f"out={tmp_path / 'runs'}", *sets]
    g, plan = api.plan("grpo", registry=registry, overrides=overrides, emit=lambda s: None)
    return g, msgspec.structs.replace(plan, fused={})


def _hf_generate_registry():
    path = Path(__file__).parents[1] / "plugins" / "hf_generate" / "__init__.py"
    spec = importlib.util.spec_from_file_location("hf_generate", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return load_plugins(entry_points=False, extra=[("hf_generate", module)])[1]


def test_a_plan_generating_with_another_engine_is_refused_naming_it(tmp_path):
    """The loop samples with the training engine itself; a plan that samples with a plugin's engine
    would otherwise run silently with the wrong one."""
    reg = _hf_generate_registry()
    g, plan = _plan(tmp_path, "generation.engine=hf_generate", registry=reg)
    with pytest.raises(PlanError, match="node 'rollout'.*generates with 'hf_generate'.*generation.engine=local"):
        run_serial(g, plan, registry=reg)


def test_a_plan_splitting_a_model_over_several_ranks_is_refused_naming_the_model(tmp_path):
    g, plan = _plan(tmp_path)
    layout = plan.layout
    assert layout is not None
    models = tuple(
        msgspec.structs.replace(m, parallel=Parallel(dp=2, tp=1, pp=1)) if m.model == "actor" else m
        for m in layout.models
    )
    split = msgspec.structs.replace(plan, layout=msgspec.structs.replace(layout, models=models))
    with pytest.raises(PlanError, match="model 'actor'.*one rank.*dp 2 x tp 1 x pp 1"):
        run_serial(g, split)


@pytest.mark.slow
def test_a_runtime_sampling_with_stale_weights_disagrees_with_the_loop(tmp_path):
    """The equality test (test_serial_reference.py) could not pass with a runtime that samples a step
    late: the same seed and plan, one step off, give other rewards or log-probs by the second step."""
    g, plan = _plan(tmp_path)
    serial = run_serial(g, plan)
    g2, off = _plan(tmp_path / "off", "rollout.mode=one_step_off")
    real = api.run(g2, off)
    assert serial.metrics[0]["rollout/sample"] == real.metrics[0]["rollout/sample"]  # step 0: same weights
    later = {k: v for k, v in serial.metrics[1].items() if real.metrics[1].get(k) != v}
    assert later, "a one-step-stale runtime matched the serial loop"
