"""A Ray plan's memory as its workers hold it: the actor FSDP2-sharded over its data-parallel ranks
(weights, gradients and AdamW states), a full generation replica per rank kept beside it, and a
frozen reference replicated (benchmarks/memory_fidelity.py's ray-cpu2 row; a worker's live tensors
after a train step equal these states)."""

from __future__ import annotations

from flowrl import api
from flowrl.plugins.manager import registry

OVERRIDES = ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "progress=false", "train.dtype=float32"]


def _plan(*extra: str, devices: int = 2):
    overrides = [*OVERRIDES, *extra]
    _, cfg = api.load("grpo", overrides=overrides)
    target = api.local_target(cfg, registry(), devices=devices)
    pins = {"placement": "colocate"} if devices > 1 else {}  # both models over both ranks
    return api.plan(
        "grpo", overrides=overrides, target=target, for_backend=devices > 1, options=pins, emit=lambda s: None
    )[1]


def test_a_two_rank_ray_plan_holds_a_sharded_actor_and_a_generation_replica(monkeypatch):
    monkeypatch.setenv("FLOWRL_PLUGINS", "ray")  # the Ray executor's plugin (plans only: Ray is not started)
    plan = _plan("backend=ray", "device=cpu")
    assert plan.target.numerics.sharded_states
    (estimate,) = plan.memory
    params = plan.target.spec("actor").parameters()
    layout = plan.layout.layout("actor")
    assert layout.parallel.dp == 2
    states = estimate.breakdown
    # fp32 weights 4 + gradients 4 + AdamW moments 8 bytes a parameter, each over the two ranks
    assert states["model actor (weights+grads+optimizer)"] == int(params * 16 / 2)
    assert states["model actor (its generation replica's weights)"] == params * 4
    assert states["model ref (weights)"] == params * 4  # frozen: a full replica on each rank


def test_the_one_device_plan_generates_in_place_and_keeps_its_states_whole():
    plan = _plan(devices=1)
    assert not plan.target.numerics.sharded_states
    (estimate,) = plan.memory
    params = plan.target.spec("actor").parameters()
    assert estimate.breakdown["model actor (weights+grads+optimizer)"] == params * 16
    assert not any("replica" in k for k in estimate.breakdown)
