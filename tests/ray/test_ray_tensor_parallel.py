"""Tensor-parallel plans on the Ray backend, this machine as two and four devices (gloo): a tp=2
train step equals the one-process step, greedy generation by a replica split tp=2 equals the one
process's token for token, and every way a sync reaches generation replicas leaves them holding
the trainer's weights bit for bit: tp = tp' (each rank its own slices, dp2 x tp2), tp' = 1 (a tp=2
trainer into whole replicas) and tp' != tp (a dp2 trainer into a tp=2 replica).

One Ray session of four CPUs serves the module.
"""

from __future__ import annotations

import random

import pytest
import torch

from flowrl import api
from flowrl.algorithms.ops import LOSSES
from flowrl.contract.protocols import TrainStep
from flowrl.planner.constraints import parse_requirements
from flowrl.plugins.manager import registry
from flowrl.runtime.executor import PlanExecutor
from flowrl.runtime.groups import GenerationGroup, TrainingGroup, publish
from flowrl.specs import loss_unit
from flowrl.tasks.builtin import Copy

ray = pytest.importorskip("ray")

RAY_CPUS = 4  # the dp2 x tp2 plan's four workers
SMALL = ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "progress=false", "checkpoint=false"]
pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.slow]


def plan_for(devices: int, tmp_path, *require: str, extra: tuple[str, ...] = ()):
    """A colocated plan of grpo for this machine as ``devices`` devices with ``require``d layouts."""
    overrides = [*SMALL, "backend=ray", "device=cpu", f"out={tmp_path}", *extra]
    graph, cfg = api.load("grpo", overrides=overrides)
    target = api.local_target(cfg, registry(), devices=devices)
    need = parse_requirements(require, graph.models)
    return api.plan(
        "grpo", overrides=overrides, target=target, for_backend=True, options={"require": need}, emit=lambda s: None
    )


def same_bits(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def held_by_every_replica(ex_transport, sched, model: str = "actor") -> list[dict]:
    gen = list(sched.generation_ranks(model))
    return ex_transport.call(gen, "generation_weights", [(model,)] * len(gen), "check")


def test_a_dp2_x_tp2_plan_runs_and_each_rank_syncs_its_own_slices_bit_for_bit(tmp_path):
    """cpu:4: the actor FSDP2 over dp 2 of tensor-parallel pairs, generation by two tp=2 replicas on the same
    ranks. Each sync moves each rank's own tp slices (half the model a rank), and every replica then holds
    the trainer's weights bit for bit."""
    g, plan = plan_for(4, tmp_path, "actor.dp=2", "actor.tp=2", "generation.tp=2", extra=("steps=2",))
    actor, gen = plan.layout.layout("actor").parallel, plan.layout.generation
    assert (actor.dp, actor.tp, gen.tp, gen.replicas, plan.layout.weight_sync.strategy) == (2, 2, 2, 2, "reshard")
    ex = api.check(g, plan)
    sent = []

    def on_step(record):
        trainer = list(ex.lowered.ranks_of("actor"))
        full = ex.transport.call(trainer, "export_weights", [("actor",)] * len(trainer), "check")[0]
        for held in held_by_every_replica(ex.transport, ex.lowered):
            assert same_bits(held, full)
        sent.append((record["sync:train_actor/bytes"], sum(t.numel() * t.element_size() for t in full.values())))

    result = api.run(g, plan, executor=ex, on_step=on_step)
    assert [m["step"] for m in result.metrics] == [0, 1]
    assert all(0 < b < 0.75 * whole for b, whole in sent), sent  # slices (and the whole norms), not the model


def _step(algo, micro: int) -> TrainStep:
    fn, meta = LOSSES["ppo"]
    return TrainStep(
        node="train_actor",
        sequences_key="responses",
        output="logprobs",
        micro_batch=micro,
        epochs=1,
        mini_batches=2,
        algo=algo,
        generator=torch.Generator().manual_seed(7),
        unit=loss_unit(meta["aggregate"], algo),
    )


def _launch(g, plan, tmp_path):
    ex = api.check(g, plan)
    sched = ex.schedule(g, plan)
    transport, built = ex.launch(g, plan, sched, tmp_path)
    return sched, transport, built


def test_a_tp2_train_step_on_ray_equals_the_one_process_step_and_whole_replicas_get_it_bit_for_bit(tmp_path):
    """cpu:2, actor tp 2 (the default tiny model: one key/value head, held whole by both ranks), generation
    by whole replicas on the same ranks (tp' = 1). Loss and gradient norm agree within 1e-5 (relative);
    the update within 2 % of lr -- AdamW's first step moves every weight by about lr whatever the size
    of its gradient, so fp32 rounding of near-zero gradients shows there (tests/backends/parallelize/test_tensor.py)."""
    g2, plan2 = plan_for(2, tmp_path, "actor.tp=2")
    assert plan2.layout.layout("actor").parallel.tp == 2 and plan2.layout.generation.tp == 1
    sched, transport, built = _launch(g2, plan2, tmp_path)
    try:
        split = TrainingGroup(g2.models["actor"], sched.ranks_of("actor"), transport, *built["actor"], tp=2)
        g1, plan1 = api.plan("grpo", overrides=[*SMALL, "device=cpu"], emit=lambda s: None)
        local = PlanExecutor(registry()).engines(g1, plan1)[0]["actor"]
        start = local.export_weights()
        assert same_bits(split.export_weights(), start)  # both built the same initial weights

        prompts = Copy().prompts(random.Random(0), 5)
        seqs = local.generate(prompts, n=3, greedy=False, generator=torch.Generator().manual_seed(0)).sequences
        noise = torch.Generator().manual_seed(1)
        logp = local.forward(seqs, "logprobs", 0)
        assert float((split.forward(seqs, "logprobs", 0) - logp).abs().max()) < 1e-5
        batch = {
            "responses": seqs,
            "old_logprobs": logp + 0.05 * torch.randn(logp.shape, generator=noise),  # ratios off 1: some rows clip
            "advantages": torch.randn(len(seqs), 1, generator=noise) * seqs.response_mask,
        }
        fn = LOSSES["ppo"][0]
        stats1 = local.train(fn, batch, _step(plan1.config.algo, len(seqs)))
        stats2 = split.train(fn, batch, _step(plan1.config.algo, 3))
        after1, after2 = local.export_weights(), split.export_weights()
        lr = plan1.model_run("actor").optimizer.lr
        assert abs(stats1["loss"] - stats2["loss"]) < 1e-5 * max(1.0, abs(stats1["loss"]))
        assert abs(stats1["grad_norm"] - stats2["grad_norm"]) < 1e-5 * max(1.0, stats1["grad_norm"])
        assert max(float((after1[k] - start[k]).abs().max()) for k in start) > 0.5 * lr  # the step did something
        assert max(float((after1[k] - after2[k]).abs().max()) for k in start) < 0.02 * lr

        generator = GenerationGroup("actor", sched.generation_ranks("actor"), transport, 0, tp=1)
        publish(split, generator, "reshard", "sync")  # tp 2 -> whole replicas
        for held in held_by_every_replica(transport, sched):
            assert same_bits(held, after2)
    finally:
        transport.close()


def test_a_tp2_replica_generates_what_one_process_generates_and_takes_a_dp2_trainers_weights(tmp_path):
    """cpu:2, actor FSDP2 dp 2, generation by one replica split tp 2 over the same ranks (tp' != tp): its
    greedy tokens equal the one-process model's token for token, before and after a sync, which leaves
    both of its ranks holding the trained weights bit for bit."""
    g2, plan2 = plan_for(2, tmp_path, "actor.dp=2", "generation.tp=2")
    assert plan2.layout.layout("actor").parallel.dp == 2 and plan2.layout.generation.tp == 2
    sched, transport, built = _launch(g2, plan2, tmp_path)
    try:
        trainer = TrainingGroup(g2.models["actor"], sched.ranks_of("actor"), transport, *built["actor"])
        generator = GenerationGroup("actor", sched.generation_ranks("actor"), transport, 0, tp=2)
        assert generator.replicas == [(0, 1)]
        g1, plan1 = api.plan("grpo", overrides=[*SMALL, "device=cpu"], emit=lambda s: None)
        local = PlanExecutor(registry()).engines(g1, plan1)[0]["actor"]
        prompts = Copy().prompts(random.Random(0), 6)

        def greedy(engine):
            return engine.generate(prompts, n=2, greedy=True, generator=torch.Generator().manual_seed(0)).sequences

        assert torch.equal(greedy(generator).response_ids, greedy(local).response_ids)
        seqs = local.generate(prompts, n=2, greedy=False, generator=torch.Generator().manual_seed(3)).sequences
        noise = torch.Generator().manual_seed(1)
        batch = {
            "responses": seqs,
            "old_logprobs": local.forward(seqs, "logprobs", 0),
            "advantages": torch.randn(len(seqs), 1, generator=noise) * seqs.response_mask,
        }
        trainer.train(LOSSES["ppo"][0], batch, _step(plan1.config.algo, 4))
        publish(trainer, generator, "reshard", "sync")  # dp 2 -> tp 2: each rank slices the gathered weights
        trained = trainer.export_weights()
        for held in held_by_every_replica(transport, sched):
            assert same_bits(held, trained)
        local.import_weights(trained)
        assert torch.equal(greedy(generator).response_ids, greedy(local).response_ids)
    finally:
        transport.close()
