"""The planner costs each generation engine with what `flowrl profile` measured of it
(``HardwareSpec.generation``), and with ``generation.engine=auto`` (the default) picks the one it
predicts fastest among the training engine's own and the calibrated engines that run the model."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest

from flowrl import api
from flowrl.contract.hardware import GenerationCalibration, save_hardware
from flowrl.errors import PlanError
from flowrl.planner.cost import CostModel
from flowrl.planner.hardware import load_hardware
from flowrl.planner.passes import PassResults
from flowrl.plugins.hookspecs import hookimpl
from flowrl.plugins.manager import load_plugins, set_registry

HEAD32 = ["tiny_model.num_heads=2", "tiny_model.num_kv_heads=1", "progress=false"]
FAST = GenerationCalibration(kernel_overhead=1e-7, matmul_efficiency=1.0, load_bandwidth=1e12)
SLOW = GenerationCalibration(kernel_overhead=0.05, matmul_efficiency=0.001, load_bandwidth=1e5)


class NotRun:
    """A registered generation engine (planning never builds it)."""

    def __init__(self, ctx) -> None:
        raise AssertionError("the planner must not build engines")


class Engines:
    @hookimpl
    def register_generation_engines(self, register):
        register("fast", NotRun, description="a made-up fast engine")
        register("slow", NotRun, description="a made-up slow engine")


@pytest.fixture
def reg():
    _, registry = load_plugins(entry_points=False, extra=[("engines", Engines())])
    set_registry(registry)
    yield registry
    set_registry(None)


def plan_with(reg, calibrations, *overrides, results=None):
    """A local plan of GRPO whose machine carries ``calibrations``."""
    sets = [*HEAD32, *overrides]
    _, cfg = api.load("grpo", overrides=sets)
    target = api.local_target(cfg, reg)
    hw = msgspec.structs.replace(target.cluster.hardware, generation=calibrations)
    target = msgspec.structs.replace(target, cluster=msgspec.structs.replace(target.cluster, hardware=hw))
    return api.plan("grpo", registry=reg, overrides=sets, target=target, results=results, emit=lambda s: None)[1]


def test_auto_picks_the_engine_it_predicts_fastest_and_says_why(reg):
    results = PassResults()
    plan = plan_with(reg, {"fast": FAST, "slow": SLOW}, results=results)
    assert plan.config.generation.engine == "fast"
    predicted = results.place.engines
    assert set(predicted) == {"local", "fast", "slow"}
    assert predicted["fast"] < predicted["local"] < predicted["slow"]
    assert plan.layout.predicted.iteration_s == pytest.approx(predicted["fast"])
    assert results.place.tune.ranked[0].result.iteration_s == pytest.approx(predicted["fast"])


def test_a_slow_calibration_loses_to_the_training_engines_own_sampler(reg):
    assert plan_with(reg, {"slow": SLOW}).config.generation.engine == "local"


def test_engines_without_a_calibration_or_for_another_head_size_are_not_candidates(reg):
    assert plan_with(reg, {}).config.generation.engine == "local"  # 'fast' is installed but never measured
    narrow = msgspec.structs.replace(FAST, head_sizes=(64, 128))  # the model's heads are 32 wide
    assert plan_with(reg, {"fast": narrow}).config.generation.engine == "local"
    wide = msgspec.structs.replace(FAST, head_sizes=(32,))
    assert plan_with(reg, {"fast": wide}).config.generation.engine == "fast"


def test_a_configured_engine_is_kept_and_costed_with_its_calibration(reg):
    slow = plan_with(reg, {"fast": FAST, "slow": SLOW}, "generation.engine=slow")
    local = plan_with(reg, {"fast": FAST, "slow": SLOW}, "generation.engine=local")
    assert slow.config.generation.engine == "slow" and local.config.generation.engine == "local"
    assert slow.layout.predicted.iteration_s > 2 * local.layout.predicted.iteration_s


def test_bf16_leaves_only_separate_engines_and_none_calibrated_is_refused(reg):
    plan = plan_with(reg, {"slow": SLOW}, "generation.dtype=bfloat16")
    assert plan.config.generation.engine == "slow"  # the training engine samples in float32 only
    with pytest.raises(PlanError, match="generation.dtype=bfloat16.*generation.engine=NAME"):
        plan_with(reg, {}, "generation.dtype=bfloat16")


def test_a_calibration_costs_decode_and_the_in_place_weight_load(reg):
    plan = plan_with(reg, {"slow": SLOW})
    base = CostModel(plan.target.model, plan.target.cluster.hardware)
    hw = msgspec.structs.replace(base.hw, generation={"slow": SLOW})
    cost = CostModel(plan.target.model, hw)
    assert cost.for_engine("slow").prefill(8, 8, 1) > cost.prefill(8, 8, 1)
    assert cost.for_engine("slow").engine_load(1e6) == pytest.approx(10.0)  # 1 MB at 100 kB/s
    assert cost.engine_load(1e6) == 0.0 and cost.for_engine("unmeasured").engine_load(1e6) == 0.0


def test_hardware_files_keep_their_engine_calibrations(tmp_path, reg):
    hw = msgspec.structs.replace(
        plan_with(reg, {}).target.cluster.hardware, generation={"vllm": msgspec.structs.replace(FAST, head_sizes=(32,))}
    )
    assert load_hardware(save_hardware(hw, tmp_path / "hw.yaml")) == hw


@pytest.mark.slow
def test_plan_explain_names_the_generation_engine():
    out = subprocess.run(
        [sys.executable, "-m", "flowrl", "plan", "grpo", "--explain"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert "generation engine: local" in out.stdout
