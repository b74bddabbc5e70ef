"""Numerics as engine options (train.dtype, train.attention, train.recompute): the planner resolves
them per device and prices memory as the engine computes; the torch engine computes as resolved --
bfloat16 under autocast from float32 master weights, the SDPA or eager kernel, recomputed layers --
and what it samples is what it trains on."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from flowrl import api
from flowrl.contract.protocols import TrainStep
from flowrl.errors import ConfigError
from flowrl.planner.hardware import HARDWARE_PRESETS
from flowrl.planner.passes import resolve_numerics
from flowrl.plugins.manager import registry
from flowrl.runtime.executor import PlanExecutor
from flowrl.specs import TrainConfig
from flowrl.tasks.builtin import Copy

SMALL = ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=2", "task=copy", "train.grad_clip=1e9"]


def plan_for(*extra: str):
    return api.plan("grpo", overrides=[*SMALL, *extra], emit=lambda s: None)


def test_auto_is_float32_and_eager_on_this_cpu_and_bfloat16_with_sdpa_on_a_gpu():
    _, plan = plan_for()
    n = plan.models["actor"].numerics
    assert (n.dtype, n.attention, n.recompute) == ("float32", "eager", False)
    gpu = resolve_numerics(TrainConfig(), HARDWARE_PRESETS["A100-80G"])
    assert (gpu.dtype, gpu.attention) == ("bfloat16", "sdpa")
    mine = resolve_numerics(
        TrainConfig(dtype="float32", attention="eager", recompute=True), HARDWARE_PRESETS["A100-80G"]
    )
    assert (mine.dtype, mine.attention, mine.recompute) == ("float32", "eager", True)


def test_the_plan_prices_memory_as_the_engine_computes():
    _, fp32 = plan_for()
    _, bf16 = plan_for("train.dtype=bfloat16", "train.attention=sdpa", "train.recompute=true")
    assert bf16.models["actor"].numerics.dtype == "bfloat16" and bf16.models["ref"].numerics.recompute
    a, b = fp32.target.numerics, bf16.target.numerics
    assert (a.weight_bytes, a.compute_copy_bytes, a.activation_bytes, a.recompute, a.eager_attention) == (
        4, 0, 4, False, True
    )  # fmt: skip
    # float32 weights computed with a bfloat16 copy while a model computes (benchmarks/memory_fidelity.py)
    assert (b.weight_bytes, b.compute_copy_bytes, b.activation_bytes, b.recompute, b.eager_attention) == (
        4, 2, 2, True, False
    )  # fmt: skip
    breakdown = {m.group: m.breakdown for m in fp32.memory}, {m.group: m.breakdown for m in bf16.memory}
    group = next(iter(breakdown[0]))
    assert sum(breakdown[1][group].values()) != sum(breakdown[0][group].values())


def test_flash_attention_on_a_cpu_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"train.attention=flash_attention_2 needs a CUDA GPU"):
        plan_for("train.attention=flash_attention_2")


def _engines(*extra: str):
    g, plan = plan_for(*extra)
    trainers, _ = PlanExecutor(registry()).engines(g, plan)
    return trainers["actor"]


@pytest.fixture(scope="module")
def rows():
    actor = _engines()
    r = actor.generate(
        Copy().prompts(random.Random(0), 4), n=2, greedy=False, generator=torch.Generator().manual_seed(0)
    )
    seqs = r.sequences
    adv = torch.linspace(-1, 1, len(seqs))[:, None] * seqs.response_mask
    return {"responses": seqs, "old_logprobs": r.logprobs, "advantages": adv}


def _gradient(engine, batch) -> dict[str, torch.Tensor]:
    engine = copy.deepcopy(engine)
    step = TrainStep(
        node="train_actor",
        sequences_key="responses",
        output="logprobs",
        micro_batch=3,
        epochs=1,
        mini_batches=1,
        algo=engine_algo(),
        generator=torch.Generator().manual_seed(0),
    )
    engine.train(registry().get("losses", "ppo"), batch, step)
    return {n: p.grad.clone() for n, p in engine.module.named_parameters() if p.grad is not None}


def engine_algo():
    return plan_for()[1].config.algo


def _gap(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_recomputed_layers_give_the_same_gradient_and_sdpa_agrees_with_eager(rows):
    plain = _gradient(_engines(), rows)
    scale = max(float(g.abs().max()) for g in plain.values())
    recomputed = _gradient(_engines("train.recompute=true"), rows)
    assert _gap(plain, recomputed) <= 1e-6 * scale
    sdpa = _gradient(_engines("train.attention=sdpa"), rows)
    assert _gap(plain, sdpa) <= 1e-4 * scale
    assert type(_engines("train.attention=sdpa").module.config._attn_implementation) is str


def test_bfloat16_computes_in_bfloat16_keeps_float32_masters_and_samples_what_it_trains_on():
    fp32, bf16 = _engines(), _engines("train.dtype=bfloat16")
    assert all(p.dtype == torch.float32 for p in bf16.module.parameters())  # master weights
    prompts = Copy().prompts(random.Random(1), 4)
    out = {}
    for name, engine in (("fp32", fp32), ("bf16", bf16)):
        r = engine.generate(prompts, n=2, greedy=True, generator=torch.Generator().manual_seed(0))
        forward = engine.forward(r.sequences, "logprobs", 0)
        mask = r.sequences.response_mask
        assert forward.dtype == torch.float32
        assert float(((forward - r.logprobs) * mask).abs().max()) < 1e-5  # the sampler's numerics are the trainer's
        out[name] = (r.sequences, forward)
    (seqs, a), (_, b) = out["fp32"], out["bf16"]
    gap = float(((a - b) * seqs.response_mask).abs().max()) if a.shape == b.shape else None
    assert gap is None or 0 < gap < 0.1  # bfloat16 rounding: different, and close


def test_auto_takes_bfloat16_on_a_cpu_with_native_bfloat16_for_a_model_of_10m_parameters_or_more(monkeypatch):
    from flowrl.planner.passes import numerics

    cpu = plan_for()[1].target.cluster.hardware  # this machine's CPU
    monkeypatch.setattr(numerics, "cpu_has_bf16", lambda: True)
    small = resolve_numerics(TrainConfig(), cpu, numerics.CPU_BF16_PARAMETERS - 1)
    large = resolve_numerics(TrainConfig(), cpu, numerics.CPU_BF16_PARAMETERS)
    assert (small.dtype, small.attention) == ("float32", "eager")
    assert (large.dtype, large.attention) == ("bfloat16", "eager")
    monkeypatch.setattr(numerics, "cpu_has_bf16", lambda: False)  # no native bfloat16: emulated, slower
    assert resolve_numerics(TrainConfig(), cpu, 10**9).dtype == "float32"
    assert resolve_numerics(TrainConfig(dtype="float32"), cpu, 10**9).dtype == "float32"  # as configured
