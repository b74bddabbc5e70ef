"""The serial reference loop (`flowrl.runtime.serial`) and the real runtime agree: a sync-mode run
on the local backend and the loop, from the same plan and seed, give the same metrics step by step
and the same final weights, bit for bit."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import load_file

from flowrl import api
from flowrl.errors import PlanError
from flowrl.runtime.serial import run_serial

TINY = [
    "seed=1",  # first batches with non-constant rewards: the updates move the weights
    "progress=false",
    "rollout.prompts_per_step=4",
    "train.micro_batch_size=3",  # micro-batches inside each mini-batch: the same accumulation in both
]


def _plan(graph: str, tmp_path: Path, *sets: str):
    g, plan = api.plan(graph, overrides=[*TINY, f"out={tmp_path / 'runs'}", *sets], emit=lambda s: None)
    # the runtime fuses a policy's old log-prob forward into its train step where it can; the loop runs
    # every forward as its own node, so the runtime is held to that plan (fusion has its own test)
    return g, msgspec.structs.replace(plan, fused={})


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def _same_run(graph: str, tmp_path: Path, *sets: str) -> list[dict]:
    g, plan = _plan(graph, tmp_path, *sets)
    real = api.run(g, plan)
    serial = run_serial(g, plan)
    assert len(serial.metrics) == len(real.metrics) == plan.config.steps
    for step, (mine, theirs) in enumerate(zip(serial.metrics, real.metrics)):
        assert mine, step
        differ = {k: (v, theirs.get(k, "missing")) for k, v in mine.items() if theirs.get(k, "missing") != v}
        assert not differ, (step, differ)
    for model, engine in serial.trainers.items():
        if not g.models[model].trainable:
            continue
        engine.save(tmp_path / "serial" / model)
        mine, theirs = _weights(tmp_path / "serial" / model), _weights(real.checkpoints[model])
        assert mine.keys() == theirs.keys()
        for key in mine:
            assert torch.equal(mine[key], theirs[key]), (model, key)
    return serial.metrics


@pytest.mark.slow
def test_grpo_serially_equals_the_runtime(tmp_path):
    metrics = _same_run(
        "grpo", tmp_path, "steps=3", "rollout.samples_per_prompt=4", "train.mini_batches=2", "algo.kl_coef=0.05"
    )
    assert {"rollout/tokens", "reward/reward", "train_actor/loss", "train_actor/grad_norm"} <= metrics[0].keys()
    assert any(m["train_actor/grad_norm"] > 0 for m in metrics)  # the weights moved


@pytest.mark.slow
def test_ppo_with_a_critic_serially_equals_the_runtime(tmp_path):
    metrics = _same_run("ppo", tmp_path, "steps=2", "rollout.samples_per_prompt=2", "train.epochs=2")
    assert {"values/empty", "gae/empty"}.isdisjoint(metrics[0])
    assert {"train_actor/loss", "train_critic/loss", "reward/reward"} <= metrics[0].keys()


@pytest.mark.parametrize(
    ("graph", "sets", "message"),
    [
        ("dapo", (), "dynamic sampling"),
        ("grpo", ("rollout.mode=one_step_off",), "synchronous rollouts"),
    ],
)
def test_what_the_loop_does_not_run_is_refused_before_any_model_is_built(graph, sets, message, tmp_path):
    g, plan = _plan(graph, tmp_path, *sets)
    with pytest.raises(PlanError, match=message):
        run_serial(g, plan)
