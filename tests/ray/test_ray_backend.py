"""The Ray backend on this machine as two devices: planned weight sync is exact, a 2-rank FSDP2
train step equals the one-process step, two generation replicas sample as one process would (each its
own contiguous share of the prompts, so GRPO groups stay whole, with its own seed: the step's seed + its
replica index), train-only plans run on Ray workers and learn (graphs/sft.py; graphs/dpo.py and
graphs/reward_model.py with each pair kept whole in one micro-batch of one rank), and what the planner chose
is what runs.

One Ray session serves the whole module (the executor joins it instead of starting its own).
"""

from __future__ import annotations

import json
import os
import random
from typing import Any

import msgspec
import pytest
import torch
from helpers import cpu_plan, resumed_after_step_1, untimed

from flowrl import api
from flowrl.algorithms.ops import LOSSES
from flowrl.contract.protocols import TrainStep
from flowrl.plugins.manager import registry
from flowrl.runtime import dispatch
from flowrl.runtime.executor import PlanExecutor
from flowrl.runtime.groups import GenerationGroup, TrainingGroup
from flowrl.specs import loss_unit
from flowrl.tasks.builtin import Copy
from flowrl_example import sequence_pg_loss

ray = pytest.importorskip("ray")

SMALL = ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "progress=false", "checkpoint=false"]


# one private Ray for the module (tests/conftest.py); runs end to end on Ray workers
pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.slow]


def cpu2_plan(graph: str, tmp_path, *extra: str, require: tuple[str, ...] = (), **pins: Any):
    """A plan of ``graph`` for this machine as two devices, for the Ray executor."""
    return cpu_plan(graph, [*SMALL, f"out={tmp_path}", *extra], 2, require, **pins)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


# 'full' (the whole state each time, no state kept between syncs): the disaggregated checkpoint run of
# tests/ray/test_ray_checkpoints_and_cli.py checks its replica after every step
@pytest.mark.parametrize("strategy", ["bucketed", "sparse"])
def test_generation_weights_equal_the_trainers_bit_for_bit_after_every_sync(tmp_path, strategy):
    g, plan = cpu2_plan("grpo", tmp_path, "steps=3", placement="disaggregated", weight_sync=strategy)
    assert plan.layout.placement == "disaggregated" and plan.layout.weight_sync.strategy == strategy
    ex = api.check(g, plan)
    checked = []

    def on_step(record):
        transport = ex.transport
        sched = ex.lowered
        trainer = sched.ranks_of("actor")
        gen = sched.generation_ranks("actor")
        assert not set(trainer) & set(gen)  # the replicas live in other processes
        full = transport.call(list(trainer), "export_weights", [("actor",)] * len(trainer), "check")[0]
        for rank, held in zip(gen, transport.call(list(gen), "generation_weights", [("actor",)] * len(gen), "check")):
            assert held.keys() == full.keys()
            for k in full:
                assert torch.equal(bits(held[k]), bits(full[k])), f"{strategy}: rank {rank} '{k}' differs"
        checked.append(record["sync:train_actor/bytes"])

    result = api.run(g, plan, executor=ex, on_step=on_step)
    assert len(checked) == 3 and all(b > 0 for b in checked)
    if strategy == "sparse":  # never more than the whole state (plus a count per bucket)
        assert max(checked[1:]) <= checked[0] + 8 * 16
    spans = result.metrics[-1]["spans"]
    assert "sync:train_actor" in spans
    trace = json.loads((result.out_dir / "trace.json").read_text())
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert {"driver", "rank 0 (gen)", "rank 1 (train)"} <= names or {
        "driver",
        "rank 0 (train)",
        "rank 1 (gen)",
    } <= names
    assert any(e["ph"] == "X" and e["pid"] == 2 for e in trace["traceEvents"])  # rank 1's own spans
    assert (result.out_dir / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    workers = json.loads((result.out_dir / "workers.json").read_text())
    assert [w["rank"] for w in workers] == [0, 1] and all(w["pid"] != os.getpid() for w in workers)


LOSS_CASES = [
    ("ppo", {}),
    ("ppo", {"loss_agg": "seq-mean-token-mean"}),
    ("ppo", {"loss_agg": "seq-mean-token-sum-norm", "loss_norm": 24}),
    ("gspo", {}),
    ("sequence_pg", {}),  # a plugin's sequence-level loss
]


def test_a_two_rank_fsdp2_train_step_equals_the_one_process_step(tmp_path):
    """... with the actor's optimizer offloaded (FSDP2's CPUOffloadPolicy: the shards, their gradients
    and the optimizer states in host memory), which the layout asks for and the local engine declares."""
    g2, plan2 = cpu2_plan("grpo", tmp_path, placement="colocate", require=("actor.dp=2",))
    assert plan2.layout.layout("actor").parallel.dp == 2
    offloaded = [msgspec.structs.replace(m, offload_optimizer=m.model == "actor") for m in plan2.layout.models]
    plan2 = msgspec.structs.replace(plan2, layout=msgspec.structs.replace(plan2.layout, models=tuple(offloaded)))
    ex = api.check(g2, plan2)
    sched = ex.schedule(g2, plan2)
    transport, built = ex.launch(g2, plan2, sched, tmp_path)
    try:
        sharded = TrainingGroup(g2.models["actor"], sched.ranks_of("actor"), transport, *built["actor"])
        g1, plan1 = api.plan("grpo", overrides=[*SMALL, "device=cpu"], emit=lambda s: None)
        local = PlanExecutor(registry()).engines(g1, plan1)[0]["actor"]
        start = local.export_weights()
        same = sharded.export_weights()
        assert all(torch.equal(same[k], start[k]) for k in start)  # both built the same initial weights

        import random

        prompts = Copy().prompts(random.Random(0), 5)
        rollout = local.generate(prompts, n=3, greedy=False, generator=torch.Generator().manual_seed(0))
        seqs = rollout.sequences  # 15 rows: uneven shares, and a rank with a dummy micro-step
        width = seqs.response_ids.shape[1]  # responses of 1 to the whole budget of tokens
        lengths = torch.tensor([1 + (i * 7) % width for i in range(len(seqs))])
        seqs = seqs.replaced(response_mask=(torch.arange(width)[None, :] < lengths[:, None]).float())
        noise = torch.Generator().manual_seed(1)
        batch = {
            "responses": seqs,
            # ratios off 1, so some rows clip
            "old_logprobs": local.forward(seqs, "logprobs", 0) + 0.05 * torch.randn(len(seqs), width, generator=noise),
            "ref_logprobs": local.forward(seqs, "logprobs", 0) - 0.01,
            "advantages": torch.randn(len(seqs), 1, generator=noise) * seqs.response_mask,
        }
        # every way a loss aggregates, on rows of different lengths: the two ranks' accumulated step
        # (micro-batches of 3 rows per rank) equals one process taking each mini-batch whole
        for name, options in LOSS_CASES:
            if name == "sequence_pg":
                fn, aggregate = sequence_pg_loss, "seq-mean"
            else:
                fn, meta = LOSSES[name]
                aggregate = meta["aggregate"]
            algo = msgspec.structs.replace(plan1.config.algo, **options)

            def step(micro: int) -> TrainStep:
                return TrainStep(
                    node="train_actor",
                    sequences_key="responses",
                    output="logprobs",
                    micro_batch=micro,
                    epochs=1,
                    mini_batches=2,
                    algo=algo,
                    generator=torch.Generator().manual_seed(7),
                    unit=loss_unit(aggregate, algo),
                )

            before1, before2 = local.export_weights(), sharded.export_weights()
            stats1 = local.train(fn, batch, step(len(seqs)))
            stats2 = sharded.train(fn, batch, step(3))
            after1, after2 = local.export_weights(), sharded.export_weights()
            moved = max(float((after1[k] - before1[k]).abs().max()) for k in start)
            diff = max(float(((after1[k] - before1[k]) - (after2[k] - before2[k])).abs().max()) for k in start)
            assert moved > 1e-4, name  # the step did something
            assert diff < 1e-5 * max(1.0, moved * 100), (name, options, diff, moved)
            norm = stats1["grad_norm"]
            assert abs(norm - stats2["grad_norm"]) < 1e-4 * max(1.0, norm), (name, options)
    finally:
        transport.close()
    assert ray.is_initialized()  # the module's session: the executor did not start it, so it did not stop it


def _spans(out_dir, name):
    events = json.loads((out_dir / "trace.json").read_text())["traceEvents"]
    return [
        (e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X" and e.get("pid") == 0 and e["name"] == name
    ]


@pytest.mark.parametrize("mode", ["one_step_off", "partial+async"])
def test_rollout_modes_overlap_generation_with_training_on_two_groups(tmp_path, mode):
    """Generation of step k+1 runs on its group while step k trains on the other: the trace shows the
    second rollout starting before the first training ended (a sync run waits for it: its new weights),
    and the samples trained are one version old (within the bound). How much the spans overlap depends on
    the box's load; that one starts before the other ends does not."""
    g, plan = cpu2_plan(
        "grpo",
        tmp_path,
        "steps=4",
        f"rollout.mode={mode}",
        "task=repeat",
        "rollout.chunk_tokens=4",
        placement="disaggregated",
        weight_sync="bucketed",
    )
    assert plan.layout.rollout.mode == mode.split("+")[-1] and plan.layout.placement == "disaggregated"
    result = api.run(g, plan)
    eta = plan.layout.rollout.staleness
    assert [r["rollout/staleness_max"] <= eta for r in result.metrics] == [True] * 4
    assert any(r["rollout/staleness_1"] > 0 for r in result.metrics)
    gen, train = sorted(_spans(result.out_dir, "rollout")), sorted(_spans(result.out_dir, "train_actor"))
    assert gen[1][0] < train[0][1], (gen, train)  # the next rollout does not wait for the first training
    if "partial" in mode:
        assert any(r["rollout/recycled_tokens"] > 0 for r in result.metrics)


def test_a_resumed_fsdp2_run_restores_every_shard_and_equals_the_uninterrupted_run(tmp_path):
    g, plan = cpu2_plan(
        "grpo", tmp_path, "steps=4", "save_every=2", "checkpoint=true", placement="colocate", require=("actor.dp=2",)
    )
    assert plan.layout.placement == "colocate" and plan.layout.layout("actor").parallel.dp == 2  # FSDP2 over 2 ranks

    whole, resumed = resumed_after_step_1(g, plan, tmp_path)
    assert resumed.resumed_from == 2
    again = untimed(resumed.metrics)
    assert [r["step"] for r in again] == [0, 1, 2, 3] and untimed(whole.metrics) == again


def test_dynamic_sampling_and_a_graph_files_own_loss_run_on_ray(tmp_path):
    """The filter's rounds run on the controller; a loss registered in a graph file reaches the
    workers by value (its module cannot be imported there)."""
    src = tmp_path / "own_loss.py"
    src.write_text(
        """
from flowrl import register
from flowrl.graph import Graph


@register.loss("plain_pg", needs=("advantages",))
def plain_pg(logprobs, batch, algo):
    mask = batch["responses"].sampled_mask
    return -(logprobs * batch["advantages"] * mask).sum() / mask.sum().clamp_min(1.0), {"tokens": float(mask.sum())}


def build(cfg):
    g = Graph("own_loss")
    g.model("actor", "actor")
    g.generate("rollout", model="actor", n=4)
    g.reward("reward", fn="task")
    g.filter("keep", fn="nonconstant", reads="rewards responses", max_rounds=2)
    g.compute("advantages", fn="grpo", reads="rewards responses", writes="advantages")
    g.train("train_actor", model="actor", loss="plain_pg", reads="responses advantages")
    return g
"""
    )
    g, plan = cpu2_plan(str(src), tmp_path, "steps=2", placement="disaggregated")
    result = api.run(g, plan)
    assert [m["step"] for m in result.metrics] == [0, 1]
    for m in result.metrics:
        assert 1 <= m["keep/rounds"] <= 2 and m["train_actor/tokens"] > 0


def test_a_graph_files_own_loss_under_a_builtins_name_runs_on_ray_after_another_graph_was_planned(tmp_path):
    """A graph file's `sft` shadows the built-in inside its graph on Ray too, and keeps doing so when a
    graph of the built-ins was planned after it in the same process (the run claims the file's functions
    back)."""
    src = tmp_path / "old_sft.py"
    src.write_text(
        """
from flowrl import register
from flowrl.contract import sequences_in
from flowrl.graph import Graph


@register.loss("sft", needs=())
def sft(logprobs, batch, algo):
    mask = sequences_in(batch, "sft").sampled_mask
    return -(logprobs * mask).sum() / mask.sum(), {"own_sft": 1.0}


def build(cfg):
    g = Graph("old_sft")
    g.model("actor", "actor")
    g.generate("rollout", model="actor", reads="prompts", writes="responses", n=2)
    g.train("train_actor", model="actor", loss="sft", reads="responses")
    return g
"""
    )
    plain = tmp_path / "plain_sft.py"  # the same graph on the built-in sft
    plain.write_text(src.read_text().split("@register")[0] + "def build" + src.read_text().split("def build")[1])
    g, plan = cpu2_plan(str(src), tmp_path, "steps=1")
    cpu2_plan(str(plain), tmp_path / "plain", "steps=1")  # loading it gives the built-in back, for its graph
    result = api.run(g, plan)
    assert result.metrics[0]["train_actor/own_sft"] == 1.0


def test_two_replicas_sample_their_own_prompts_with_their_own_seeds_as_one_process_would(tmp_path):
    overrides = [*SMALL, "backend=ray", "device=cpu", f"out={tmp_path}"]
    _, cfg = api.load("grpo", overrides=overrides)
    target = api.local_target(cfg, registry(), devices=2)
    g2, plan2 = api.plan(
        "grpo", overrides=overrides, target=target, for_backend=True, options={"placement": "colocate"},
        emit=lambda s: None,
    )  # fmt: skip
    assert plan2.layout.generation_of("actor").replicas == 2
    ex = api.check(g2, plan2)
    sched = ex.schedule(g2, plan2)
    transport, built = ex.launch(g2, plan2, sched, tmp_path)
    try:
        tokenizer = built["actor"][0]
        group = GenerationGroup("actor", sched.generation_ranks("actor"), transport, tokenizer.pad_token_id)
        assert len(group.replicas) == 2
        g1, plan1 = api.plan("grpo", overrides=[*SMALL, "device=cpu"], emit=lambda s: None)
        local = PlanExecutor(registry()).engines(g1, plan1)[1]["actor"]  # one process, the same initial weights

        prompts, n = Copy().prompts(random.Random(0), 6), 4
        rollout = group.generate(prompts, n=n, greedy=False, generator=torch.Generator().manual_seed(3))
        seed = dispatch.draw_seed(torch.Generator().manual_seed(3))  # what the group drew for this call
        seqs = rollout.sequences
        # every prompt's samples on one replica, in prompt order: groups are whole
        assert seqs.prompt_index.tolist() == torch.arange(len(prompts)).repeat_interleave(n).tolist()

        cuts = dispatch.shards(len(prompts), 2)
        for i, cut in enumerate(cuts):
            rows = slice(cut.start * n, cut.stop * n)
            own = local.generate(prompts[cut], n=n, greedy=False, generator=torch.Generator().manual_seed(seed + i))
            assert seqs.texts[rows] == own.sequences.texts, f"replica {i} did not sample as one process with its seed"
            width = own.logprobs.shape[1]
            assert torch.allclose(rollout.logprobs[rows, :width], own.logprobs, atol=1e-5)
            if i > 0:  # the replicas do not share a random stream: replica 0's seed gives other samples here
                same = local.generate(prompts[cut], n=n, greedy=False, generator=torch.Generator().manual_seed(seed))
                assert same.sequences.texts != own.sequences.texts
    finally:
        transport.close()


def test_sft_runs_on_ray_workers_and_its_loss_falls(tmp_path):
    graph, plan = cpu_plan(
        "graphs/sft.py", ["progress=false", "checkpoint=false", "steps=6", "rollout.prompts_per_step=8"], 2
    )
    assert plan.config.executor == "ray" and [n.kind for n in plan.nodes] == ["source", "train"]
    result = api.run(graph, plan, out_dir=tmp_path / "run")
    nll = [m["train_actor/nll"] for m in result.metrics]
    assert len(nll) == 6 and nll[-1] < nll[0]


def test_dpo_runs_on_ray_workers_and_its_margin_grows(tmp_path):
    graph, plan = cpu_plan(
        "graphs/dpo.py", ["progress=false", "checkpoint=false", "steps=6", "rollout.prompts_per_step=8"], 2
    )
    assert plan.config.executor == "ray" and [n.kind for n in plan.nodes] == ["source", "forward", "train"]
    result = api.run(graph, plan, out_dir=tmp_path / "run")
    margins = [m["train_actor/margin"] for m in result.metrics]
    assert len(margins) == 6 and margins[-1] > margins[0]


def test_a_reward_model_trains_data_parallel_on_ray_workers(tmp_path):
    overrides = ["progress=false", "checkpoint=false", "steps=6", "rollout.prompts_per_step=8", "train.lr=1e-3"]
    graph, plan = cpu_plan("graphs/reward_model.py", overrides, 2, require=("rm.dp=2",))
    assert plan.config.executor == "ray" and [n.kind for n in plan.nodes] == ["source", "train"]
    result = api.run(graph, plan, out_dir=tmp_path / "run")
    accuracy = [m["train_rm/pref_accuracy"] for m in result.metrics]
    loss = [m["train_rm/loss"] for m in result.metrics]
    assert len(accuracy) == 6 and sum(loss[-2:]) < sum(loss[:2])
