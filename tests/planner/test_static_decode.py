"""Generation in static batches (`Numerics.static_decode`, `flowrl plan --decode-batch static:N`): each batch of a
replica decodes until its longest response ends before the next starts, so the rollout costs waves of the tail,
and more replicas (fewer waves each) shorten it; and FSDP's collectives hidden behind a micro-batch's compute."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from flowrl.cli import _with_decode_batch, main
from flowrl.contract.layout import GenerationLayout, ModelLayout, Parallel
from flowrl.contract.numerics import Numerics
from flowrl.contract.plan import load_plan
from flowrl.errors import ConfigError
from flowrl.planner.cost import CostModel
from flowrl.planner.hardware import HARDWARE_PRESETS
from flowrl.planner.memory import generation_bytes
from flowrl.planner.modelspec import MODEL_PRESETS

FAST = ["--budget", "1"]


def _plan(tmp_path, *extra: str, cluster: str = "8xH100-80G") -> tuple:
    out = tmp_path / "plan.yaml"
    workload = tmp_path / "w.yaml"
    workload.write_text(
        "prompts_per_step: 256\nsamples_per_prompt: 1\nprompt_length: 128\n"
        "response_length: {kind: lognormal, median: 300, sigma: 0.8, max: 2048}\n"
    )
    argv = ["plan", "grpo", "--cluster", cluster, "--model", "llama-7b", "--workload", str(workload)]
    argv += ["--require", "placement=colocate", "--require", "generation.tp=1", *FAST, "--out", str(out), "--force"]
    assert main([*argv, *extra]) == 0
    plan = load_plan(out)
    return plan, plan.layout.predicted.breakdown["rollout"]


def test_static_batches_decode_in_waves_of_the_tail_and_cost_more_than_continuous(tmp_path):
    plan, static = _plan(tmp_path, "--decode-batch", "static:8")
    assert plan.target.numerics.static_decode and plan.target.numerics.decode_batch == 8
    _, continuous = _plan(tmp_path, "--decode-batch", "8")
    _, default = _plan(tmp_path)
    # 32 sequences a replica in 4 static batches of 8: each waits for its longest response
    assert static > 1.2 * continuous
    assert continuous >= default  # at most 8 at once is no faster than the default 256


def test_more_replicas_mean_fewer_static_waves(tmp_path):
    _, eight = _plan(tmp_path, "--decode-batch", "static:8")
    _, sixteen = _plan(tmp_path, "--decode-batch", "static:8", cluster="2x8xH100-80G")
    assert sixteen < 0.75 * eight


def test_static_batches_are_part_of_the_plan_id_and_the_default_is_written(tmp_path):
    plan, _ = _plan(tmp_path)
    assert msgspec.to_builtins(plan.target.numerics)["static_decode"] is False
    static, _ = _plan(tmp_path, "--decode-batch", "static:256")
    assert plan.id == plan.content_id() and static.id != plan.id


@pytest.mark.parametrize("value", ["static:0", "dynamic:8", "eight", "static:"])
def test_a_malformed_decode_batch_is_refused_with_the_form_to_give(tmp_path, value, capsys):
    workload = tmp_path / "w.yaml"
    workload.write_text("prompts_per_step: 8\nsamples_per_prompt: 1\n")
    argv = ["plan", "grpo", "--cluster", "8xH100-80G", "--model", "llama-7b", "--workload", str(workload)]
    assert main([*argv, "--decode-batch", value, *FAST]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"--decode-batch {value}" in err and "static:N" in err


def test_decode_batch_forecasts_a_named_cluster_only():
    with pytest.raises(ConfigError, match="add --cluster"):
        _with_decode_batch(None, "static:8")


def test_a_static_batch_holds_its_sequences_at_full_length():
    model = MODEL_PRESETS["llama-7b"]
    gen = GenerationLayout(group="all", tp=1, replicas=1)
    one = generation_bytes(model, Numerics(), gen, 64, 2048)
    eight = generation_bytes(model, Numerics(decode_batch=8, static_decode=True), gen, 64, 2048)
    every = generation_bytes(model, Numerics(decode_batch=None), gen, 64, 2048)
    kv = 2048 * model.kv_bytes_per_token(2)
    assert eight - one == 7 * kv and every - one == 63 * kv


def test_fsdp_gathers_hide_behind_long_micro_batches_but_not_short_ones():
    cost = CostModel(MODEL_PRESETS["llama-7b"], HARDWARE_PRESETS["H100-80G"])

    def exposed(micro_tokens: int) -> float:
        lay = ModelLayout(model="actor", group="g", parallel=Parallel(dp=8, tp=1, pp=1), micro_batch=1)
        rows = 256
        sharded = cost.forward(lay, rows, micro_tokens, backward=True, sharded=True)
        return (sharded - cost.forward(lay, rows, micro_tokens, backward=True, sharded=False)) / (rows // 8)

    gather = cost.allreduce(cost.param_bytes / (cost.model.layers + 1), 8, span=8) / 2
    long, short = exposed(8192), exposed(64)
    assert long == pytest.approx(gather, rel=1e-6)  # only the first unit's gather waits
    # a short micro-batch waits for nearly all of its three collectives per unit (gather, re-gather, reduce-scatter)
    assert short > 2 * (cost.model.layers + 1) * gather
    assert np.isfinite(short)
