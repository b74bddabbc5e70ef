"""The cost model uses the work-dependent efficiency: the curve fitted to published runs of the
device's GPU family, or one a cluster file (or profile) carries for its own hardware."""

from __future__ import annotations

import msgspec
import numpy as np

from flowrl.planner.cost import CostModel
from flowrl.planner.efficiency import curve_for
from flowrl.planner.hardware import HARDWARE_PRESETS, parse_cluster
from flowrl.planner.modelspec import MODEL_PRESETS
from flowrl.planner.space import ModelLayout, Parallel

H100 = HARDWARE_PRESETS["H100-80G"]
MODEL = MODEL_PRESETS["llama3-8b"]


def layout(micro_batch: int) -> ModelLayout:
    return ModelLayout(model="actor", group="all", parallel=Parallel(dp=1, tp=1, pp=1), micro_batch=micro_batch)


def test_small_micro_batches_run_further_from_peak_than_large_ones():
    cost = CostModel(MODEL, H100)
    # the same 256 sequences of 512 tokens: one sequence per call is slower than 32 per call
    assert cost.forward(layout(1), 256, 512, backward=True) > 1.2 * cost.forward(layout(32), 256, 512, backward=True)
    assert cost.efficiency(32 * 512, 512, 1) > cost.efficiency(512, 512, 1) > cost.efficiency(8, 512, 1)


def test_a_decode_step_at_batch_one_is_bound_by_streaming_the_weights():
    cost = CostModel(MODEL, H100)
    step = float(cost.decode_step(np.array([1.0]), np.array([512.0]), 1)[0])
    weights = cost.stream(cost.param_bytes)
    assert weights <= step < 1.5 * weights + MODEL.layers * H100.kernel_overhead


def test_a_cluster_file_can_carry_its_own_curve(tmp_path):
    mine = msgspec.structs.replace(curve_for(H100), e_max=curve_for(H100).e_max / 2)
    path = tmp_path / "cluster.yaml"
    fields = msgspec.to_builtins(mine)
    block = "".join(f"    {k}: {v}\n" for k, v in fields.items())
    path.write_text(f"nodes: 1\nhardware:\n  preset: H100-80G\n  efficiency:\n{block}")
    cluster = parse_cluster(str(path))
    assert cluster.hardware.efficiency == mine
    slow, default = CostModel(MODEL, cluster.hardware), CostModel(MODEL, H100)
    big = layout(64)
    assert slow.forward(big, 512, 2048, backward=False) > 1.6 * default.forward(big, 512, 2048, backward=False)


def test_this_machines_cpu_keeps_the_profiled_constant():
    cpu = msgspec.structs.replace(H100, name="cpu", matmul_efficiency=0.3)
    assert CostModel(MODEL, cpu).curve is None and CostModel(MODEL, cpu).efficiency(4096, 512, 1) == 0.3
