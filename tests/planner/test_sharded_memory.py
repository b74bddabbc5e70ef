"""A Ray plan's memory as its workers hold it: the actor FSDP2-sharded over its data-parallel ranks
(weights, gradients and AdamW states), a full generation replica per rank kept beside it, and a
frozen reference replicated (benchmarks/memory_fidelity.py's ray-cpu2 row; a worker's live tensors
after a train step equal these states)."""

from __future__ import annotations

from flowrl import api
from flowrl.planner.constraints import parse_requirements
from flowrl.plugins.manager import registry

OVERRIDES = ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "progress=false", "train.dtype=float32"]


def _plan(*extra: str, devices: int = 2):
    overrides = [*OVERRIDES, *extra]
    _, cfg = api.load("grpo", overrides=overrides)
    target = api.local_target(cfg, registry(), devices=devices)
    # both models over both ranks, the actor FSDP2-sharded (the engine could split it into pipeline stages instead)
    sharded = {"require": parse_requirements(["actor.dp=2"], ["actor", "ref"])}
    pins = {"placement": "colocate", **sharded} if devices > 1 else {}
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


def _train_peak(plan) -> int:
    (estimate,) = plan.memory
    return next(v for k, v in estimate.breakdown.items() if k.startswith("peak: node train_actor"))


def test_a_sharded_train_step_holds_every_layer_gathered_and_accumulates_whole_gradients(monkeypatch):
    """The torch engine keeps a sharded model's layers gathered from a forward to its backward
    (reshard_after_forward=False) and, over a mini-batch's micro-steps, the unsharded gradients it
    reduces at the last: the Ray executor declares it, and the train step's peak prices it."""
    import msgspec

    from flowrl.planner import memory as mem

    monkeypatch.setenv("FLOWRL_PLUGINS", "ray")
    peaks = {}
    for size, steps in ((8, 1), (4, 2)):  # 16 rows over 2 ranks: one micro-step of 8 rows a rank, or two of 4
        plan = _plan("backend=ray", "device=cpu", f"train.micro_batch_size={size}", "train.mini_batches=1")
        numerics, spec = plan.target.numerics, plan.target.spec("actor")
        layout = msgspec.structs.replace(plan.layout.layout("actor"), micro_batch=size)
        assert numerics.gather_whole and layout.parallel.dp == 2 and mem.micro_steps(16, layout, size) == steps
        acts = mem.activation_bytes(spec, numerics, layout, plan.workload.max_sequence(), training=True)
        peaks[steps] = _train_peak(plan) - acts
    spec = plan.target.spec("actor")
    layer = spec.layer_parameters()
    whole = spec.layers * layer + spec.vocab * spec.hidden * 2 + spec.hidden  # every layer and the root
    assert peaks[1] == int(whole * 4 + layer * 4)  # float32, gathered; one layer's unsharded gradient at a time
    assert peaks[2] == int(whole * 4 + whole * 4)  # the whole model's gradients, until the last micro-step


def test_without_gathering_whole_two_layers_and_one_gradient_are_priced():
    from flowrl.planner import memory as mem
    from flowrl.planner.modelspec import ModelSpec
    from flowrl.planner.space import ModelLayout, Parallel

    spec = ModelSpec(name="m", layers=8, hidden=64, heads=4, kv_heads=4, intermediate=128, vocab=100)
    layout = ModelLayout(model="m", group="g", parallel=Parallel(dp=2, tp=1, pp=1), micro_batch=2)
    numerics = mem.Numerics(weight_bytes=4, grad_bytes=4, sharded_states=True)
    layer, root = spec.layer_parameters(), 100 * 64 * 2 + 64
    for steps in (1, 3):  # gradients reduced per micro-batch: no accumulation to hold
        expected = int((2 * layer + root) * 4 + layer * 4)
        assert mem.gathered_bytes(spec, numerics, layout, training=True, micro_steps=steps) == expected
