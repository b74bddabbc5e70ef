"""Run by test_tensor.py as WORLD processes (the ranks of a gloo group): the same model
built whole in this process and split tp=WORLD over them; its log-probs, one train step, greedy
generation and every way weights reach a generation replica split the same way are compared.
Rank 0 writes the comparison as JSON to the file it is given.

    python tests/backends/parallelize/tensor_worker.py RANK PORT OUT [WORLD]
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch

OVERRIDES = [
    "rollout.prompts_per_step=4",
    "rollout.samples_per_prompt=2",
    "progress=false",
    "checkpoint=false",
    "device=cpu",
    "train.dtype=float32",
    "train.mini_batches=2",
]
MODELS = {  # the default tiny model: 2 heads sharing one key/value head (each rank holds it whole); 4 over 2 (split)
    2: {"mqa": [], "gqa": ["tiny_model.num_heads=4", "tiny_model.num_kv_heads=2"]},
    # 2 key/value heads over 4 ranks (each rank holds both, reads its own), a vocabulary of 50 over 4 (13, 13, 13, 11)
    4: {"gqa-kv2": ["tiny_model.num_heads=4", "tiny_model.num_kv_heads=2"]},
}


def _engine(graph, plan, **dist):
    from flowrl.backends.local.factories import training_engine
    from flowrl.contract.protocols import EngineContext

    run = plan.model_run("actor")
    torch.manual_seed(run.seed)
    return training_engine(EngineContext(decl=graph.models["actor"], spec=run, device="cpu", **dist))


def _step(plan, micro):
    from flowrl.algorithms.ops import LOSSES
    from flowrl.contract.protocols import TrainStep
    from flowrl.specs import loss_unit

    fn, meta = LOSSES["ppo"]
    algo = plan.config.algo
    step = TrainStep(
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
    return fn, step


def main(rank: int, port: int, out: str, world: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results = {model: compare(rank, model, world) for model in MODELS[world]}  # one process group for all models
    for tp in sorted({world, 2}):  # tp over all ranks; with 4 ranks also dp2 x tp2 (FSDP2 shards of tp slices)
        results[f"resume tp{tp}"] = resumed(rank, world, tp, Path(out).with_name(f"ckpt-tp{tp}"))
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(results, fh)
    dist.destroy_process_group()


def _greedy(engine, prompts):
    return engine.generate(prompts, n=2, greedy=True, generator=torch.Generator().manual_seed(0)).sequences


def compare(rank: int, model: str, world: int) -> dict:
    import torch.distributed as dist

    from flowrl import api
    from flowrl.backends.local.factories import generation_engine
    from flowrl.contract.protocols import EngineContext
    from flowrl.tasks.builtin import Copy

    graph, plan = api.plan("grpo", overrides=[*OVERRIDES, *MODELS[world][model]], emit=lambda s: None)
    whole = _engine(graph, plan)
    tp = dict(rank=rank, world=world, group=dist.group.WORLD, tp=world)
    split = _engine(graph, plan, **tp)
    start, exported = whole.export_weights(), split.export_weights()
    prompts = Copy().prompts(random.Random(0), 4)
    greedy = [_greedy(whole, prompts), _greedy(split, prompts)]
    # a generation replica split alike, built from a one-rank template (each rank slices the whole weights)
    replica = generation_engine(
        EngineContext(decl=graph.models["actor"], spec=plan.model_run("actor"), device="cpu", source=whole, **tp)
    )
    rollout = whole.generate(prompts, n=2, greedy=False, generator=torch.Generator().manual_seed(0))
    seqs = rollout.sequences
    noise = torch.Generator().manual_seed(1)
    logp = whole.forward(seqs, "logprobs", 0)
    batch = {
        "responses": seqs,
        "old_logprobs": logp + 0.05 * torch.randn(logp.shape, generator=noise),  # ratios off 1: some rows clip
        "advantages": torch.randn(len(seqs), 1, generator=noise) * seqs.response_mask,
    }
    fwd = float((split.forward(seqs, "logprobs", 0) - logp).abs().max())
    local = {k: type(p).__name__ for k, p in split.module.named_parameters()}
    fn, whole_step = _step(plan, 0)  # one micro-batch a mini-batch
    stats1 = whole.train(fn, batch, whole_step)
    stats2 = split.train(fn, batch, _step(plan, 3)[1])  # micro-batches of 3 rows
    after1, after2 = whole.export_weights(), split.export_weights()
    built = replica.export_weights()
    replica.load_local_shards(split.export_local_shards(), 1)  # tp = tp': each rank its own slices
    by_shards = replica.export_weights()
    replica.load_weights(after1, 2)  # tp' from whole weights (a tp 1 trainer's, or any other layout's)
    by_whole = replica.export_weights()
    # the replica samples what the trained one-process model samples
    same_greedy = torch.equal(_greedy(whole, prompts).response_ids, _greedy(replica, prompts).response_ids)
    result = {
        "tp": world,
        "greedy_tp": torch.equal(greedy[0].response_ids, greedy[1].response_ids),
        "greedy_rows": len(greedy[0]),
        "replica_built": _same_bits(built, start),
        "reshard_shards": _same_bits(by_shards, after2),
        "reshard_whole": _same_bits(by_whole, after1),
        "greedy_replica": same_greedy,
        "same_start": all(torch.equal(start[k], exported[k]) for k in start),
        "keys": sorted(start) == sorted(exported),
        "forward": fwd,
        "loss": [stats1["loss"], stats2["loss"]],
        "grad_norm": [stats1["grad_norm"], stats2["grad_norm"]],
        "moved": max(float((after1[k] - start[k]).abs().max()) for k in start),
        "update_diff": max(float(((after1[k] - start[k]) - (after2[k] - start[k])).abs().max()) for k in start),
        "lr": plan.model_run("actor").optimizer.lr,
        "dtensors": sorted({v for v in local.values()}),
        "sharded_head": tuple(split.module.lm_head.weight.to_local().shape),
        "head": tuple(whole.module.lm_head.weight.shape),
    }
    return result


def resumed(rank: int, world: int, tp: int, folder: Path) -> dict:
    """A split model's checkpoint (`save_state` after a step) restored into a new engine: its weights and
    the next step's weights bit for bit (the optimizer state restored with them)."""
    import torch.distributed as dist

    from flowrl import api
    from flowrl.tasks.builtin import Copy

    shape = MODELS[4]["gqa-kv2"] if tp == 4 else []  # the default tiny model has two heads
    graph, plan = api.plan("grpo", overrides=[*OVERRIDES, *shape], emit=lambda s: None)
    whole = _engine(graph, plan)
    split = dict(rank=rank, world=world, group=dist.group.WORLD, tp=tp)
    first = _engine(graph, plan, **split)
    seqs = whole.generate(
        Copy().prompts(random.Random(0), 4), n=2, greedy=False, generator=torch.Generator().manual_seed(0)
    ).sequences
    noise = torch.Generator().manual_seed(1)
    batch = {
        "responses": seqs,
        "old_logprobs": whole.forward(seqs, "logprobs", 0),
        "advantages": torch.randn(len(seqs), 1, generator=noise) * seqs.response_mask,
    }
    fn, step = _step(plan, 3)
    first.train(fn, batch, step)
    folder.mkdir(exist_ok=True)
    first.save_state(folder)
    dist.barrier()  # rank 0 wrote it
    again = _engine(graph, plan, **split)
    version = again.load_state(folder)
    restored = _same_bits(first.export_weights(), again.export_weights())
    first.train(fn, batch, _step(plan, 3)[1])
    again.train(fn, batch, _step(plan, 3)[1])
    return {
        "version": version,
        "restored": restored,
        "next_step": _same_bits(first.export_weights(), again.export_weights()),
    }


def _same_bits(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 2)
