"""Run by test_pipeline.py as WORLD processes (the ranks of a gloo group): the same model built whole in
this process and in pipeline stages over them (pp=2, also with an LM head tied to the embeddings; with 4
ranks pp2 x dp2 and pp2 x tp2); their forward passes, one train step per loss and a checkpoint's resume
are compared. Rank 0 writes the comparison as JSON to the file it is given.

    python tests/backends/parallelize/pipeline_worker.py RANK PORT OUT WORLD
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import msgspec
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
# (loss, algo options, model): every built-in loss, and every way a loss aggregates (as the dp test)
LOSS_CASES = [
    ("ppo", {}, "actor"),
    ("ppo", {"loss_agg": "seq-mean-token-mean"}, "actor"),
    ("ppo", {"loss_agg": "seq-mean-token-sum-norm", "loss_norm": 24}, "actor"),
    ("gspo", {}, "actor"),
    ("sft", {}, "actor"),
    ("sequence_pg", {}, "actor"),  # a plugin's sequence-level loss
    ("value", {}, "critic"),
]
# layouts by world: name -> (pp, tp, schedule, virtual stages, extra overrides, LM head tied to the embeddings)
LAYOUTS = {
    2: {
        "gpipe": (2, 1, "gpipe", 1, [], False),
        "1f1b": (2, 1, "1f1b", 1, [], False),
        "interleaved": (2, 1, "interleaved", 2, ["tiny_model.num_layers=4"], False),
        "tied": (2, 1, "1f1b", 1, [], True),
    },
    4: {
        "pp2-dp2": (2, 1, "1f1b", 1, [], False),
        "pp2-tp2": (2, 2, "1f1b", 1, ["tiny_model.num_heads=4", "tiny_model.num_kv_heads=2"], False),
    },
}
_PLANS: dict = {}


def _plan(extra):
    """The ppo graph and plan with ``extra`` overrides (planned once per process)."""
    from flowrl import api

    key = tuple(extra)
    if key not in _PLANS:
        _PLANS[key] = api.plan("ppo", overrides=[*OVERRIDES, *extra], emit=lambda s: None)
    return _PLANS[key]


def _engine(graph, plan, model, tied=False, **dist):
    """The torch engine of ``model`` (split over ``dist``'s ranks when given); ``tied``: a tiny Llama whose
    LM head is tied to its embeddings (HF's tie_word_embeddings, as SmolLM2's), built as the engine's
    factory builds one."""
    from flowrl.backends.local.factories import local_model, training_engine
    from flowrl.backends.local.models import build_model, load_tokenizer, model_config
    from flowrl.contract.protocols import EngineContext

    run, decl = plan.model_run(model), graph.models[model]
    torch.manual_seed(run.seed)
    if not tied:
        return training_engine(EngineContext(decl=decl, spec=run, device="cpu", **dist))
    tokenizer = load_tokenizer(run.checkpoint)
    config = model_config(run.checkpoint, run.tiny, tokenizer)
    config.tie_word_embeddings = True
    module = build_model(run.checkpoint, config, run.seed, decl.scalar_head, decl.name)
    assert decl.scalar_head or module.lm_head.weight is module.model.embed_tokens.weight
    return local_model(decl, module, tokenizer, config, run, torch.device("cpu"), **dist)


def _loss(name):
    from flowrl.algorithms.ops import LOSSES

    if name == "sequence_pg":
        from flowrl_example import sequence_pg_loss

        return sequence_pg_loss, "seq-mean"
    fn, meta = LOSSES[name]
    return fn, meta["aggregate"]


def _step(algo, name, micro):
    from flowrl.contract.protocols import TrainStep
    from flowrl.specs import loss_unit

    fn, aggregate = _loss(name)
    step = TrainStep(
        node="train",
        sequences_key="responses",
        output="values" if name == "value" else "logprobs",
        micro_batch=micro,
        epochs=1,
        mini_batches=2,
        algo=algo,
        generator=torch.Generator().manual_seed(7),
        unit=loss_unit(aggregate, algo),
    )
    return fn, step


def _rows(whole):
    """15 rows of responses from 1 token to the whole budget (uneven shares, empty micro-batch slots)."""
    from flowrl.tasks.builtin import Copy

    prompts = Copy().prompts(random.Random(0), 5)
    seqs = whole.generate(prompts, n=3, greedy=False, generator=torch.Generator().manual_seed(0)).sequences
    width = seqs.response_ids.shape[1]
    lengths = torch.tensor([1 + (i * 7) % width for i in range(len(seqs))])
    return seqs.replaced(response_mask=(torch.arange(width)[None, :] < lengths[:, None]).float())


def _batch(seqs, logp, values):
    noise = torch.Generator().manual_seed(1)
    width = seqs.response_ids.shape[1]
    return {
        "responses": seqs,
        "old_logprobs": logp + 0.05 * torch.randn(len(seqs), width, generator=noise),  # ratios off 1: some clip
        "ref_logprobs": logp - 0.01,
        "advantages": torch.randn(len(seqs), 1, generator=noise) * seqs.response_mask,
        "values": values,
        "returns": torch.randn(len(seqs), width, generator=noise) * seqs.response_mask,
    }


def compare(rank: int, world: int, layout: str) -> dict:
    import torch.distributed as dist

    pp, tp, schedule, virtual, extra, tied = LAYOUTS[world][layout]
    graph, plan = _plan(extra)
    split = dict(
        rank=rank, world=world, group=dist.group.WORLD, tp=tp, pp=pp, schedule=schedule, virtual_stages=virtual
    )
    whole = {m: _engine(graph, plan, m, tied) for m in ("actor", "critic")}
    staged = {m: _engine(graph, plan, m, tied, **split) for m in ("actor", "critic")}
    seqs = _rows(whole["actor"])
    result: dict = {"layout": layout, "losses": {}}
    logp = whole["actor"].forward(seqs, "logprobs", 4)
    values = whole["critic"].forward(seqs, "values", 4)
    mask = seqs.response_mask  # past a row's response, outputs are whatever its micro-batch's width left
    result["forward"] = {
        "logprobs": float(((staged["actor"].forward(seqs, "logprobs", 4) - logp) * mask).abs().max()),
        "values": float(((staged["critic"].forward(seqs, "values", 4) - values) * mask).abs().max()),
        "scores": float(
            (staged["critic"].forward(seqs, "scores", 3) - whole["critic"].forward(seqs, "scores", 0)).abs().max()
        ),
    }
    starts = {m: (whole[m].export_weights(), staged[m].export_weights()) for m in whole}
    result["same_start"] = all(
        sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a) for a, b in starts.values()
    )
    batch = _batch(seqs, logp, values)
    for name, options, model in LOSS_CASES:
        algo = msgspec.structs.replace(plan.config.algo, **options)
        fn, step1 = _step(algo, name, len(seqs))
        _, step2 = _step(algo, name, 3)
        before1, before2 = whole[model].export_weights(), staged[model].export_weights()
        stats1 = whole[model].train(fn, batch, step1)
        stats2 = staged[model].train(fn, batch, step2)
        after1, after2 = whole[model].export_weights(), staged[model].export_weights()
        moved = max(float((after1[k] - before1[k]).abs().max()) for k in after1)
        diff = max(float(((after1[k] - before1[k]) - (after2[k] - before2[k])).abs().max()) for k in after1)
        result["losses"][f"{name} {options}"] = {
            "loss": [stats1["loss"], stats2["loss"]],
            "grad_norm": [stats1["grad_norm"], stats2["grad_norm"]],
            "moved": moved,
            "diff": diff,
            "stats": sorted(set(stats1) & set(stats2)),
            "bubble": stats2.get("pp_bubble"),
        }
    if tied:  # the first stage's embedding and the last stage's copy of it, after every step above
        weights = staged["actor"].export_weights()
        result["tied_copies_equal"] = _same_bits(
            {"w": weights["model.embed_tokens.weight"]}, {"w": weights["lm_head.weight"]}
        )
    return result


def resumed(rank: int, world: int, folder: Path, tied: bool = False) -> dict:
    """A pp=2 model's checkpoint (`save_state` after a step) restored into a new pp=2 engine: the weights,
    and the next step's weights, bit for bit. ``tied``: its LM head tied to its embeddings (stored once
    in the checkpoint, under the embedding's name, with the config's tie_word_embeddings kept)."""
    import torch.distributed as dist

    graph, plan = _plan([])
    split = dict(rank=rank, world=world, group=dist.group.WORLD, pp=2)
    first = _engine(graph, plan, "actor", tied, **split)
    fn, batch = _trained_and_saved(first, graph, plan, tied, folder)
    stored = _stored(folder)
    again = _engine(graph, plan, "actor", tied, **split)
    version = again.load_state(folder)
    restored = _same_bits(first.export_weights(), again.export_weights())
    first.train(fn, batch, _step(plan.config.algo, "ppo", 3)[1])
    again.train(fn, batch, _step(plan.config.algo, "ppo", 3)[1])
    return {
        "version": version,
        "restored": restored,
        "next_step": _same_bits(first.export_weights(), again.export_weights()),
        "one_process": _one_process_next_step(graph, plan, tied, folder, batch, first.export_weights()),
        **stored,
    }


def _one_process_next_step(graph, plan, tied: bool, folder: Path, batch: dict, staged_next: dict) -> bool | str:
    """The pp=2 checkpoint in ``folder`` resumed in one process (a user going on on one machine, or a run
    re-planned for fewer devices): whether its next step's weights are the pp=2 model's (``staged_next``)
    to fp32 rounding, or the error resuming raised."""
    from flowrl.errors import FlowRLError

    one = _engine(graph, plan, "actor", tied)
    try:
        one.load_state(folder)
    except FlowRLError as exc:
        return str(exc)
    fn, step = _step(plan.config.algo, "ppo", 3)
    one.train(fn, batch, step)
    return _close(one.export_weights(), staged_next)


def _trained_and_saved(engine, graph, plan, tied: bool, folder: Path) -> tuple:
    """``engine`` after one ppo step on the rows a whole model samples, its state saved in ``folder``
    (rank 0 writes it; every rank waits): the loss function and the batch, for the steps that follow."""
    import torch.distributed as dist

    whole = _engine(graph, plan, "actor", tied)
    seqs = _rows(whole)
    logp = whole.forward(seqs, "logprobs", 0)
    batch = _batch(seqs, logp, logp)
    fn, step = _step(plan.config.algo, "ppo", 3)
    engine.train(fn, batch, step)
    folder.mkdir(exist_ok=True)
    engine.save_state(folder)
    dist.barrier()  # rank 0 wrote it
    return fn, batch


def _close(a: dict, b: dict) -> bool:
    """Whether two exports name the same tensors, equal to fp32 rounding (1e-5)."""
    return sorted(a) == sorted(b) and all(float((a[k] - b[k]).abs().max()) < 1e-5 for k in a)


def resumed_from_dp(rank: int, world: int, folder: Path) -> dict:
    """A tied-head model's FSDP2 dp=2 checkpoint (the shared weight's optimizer state stored once, under the
    embedding's name) resumed in pp=2 stages: the next step's weights are the dp=2 model's, and the last
    stage's copy of the head takes the embedding's optimizer state, so the two copies stay equal."""
    import torch.distributed as dist

    graph, plan = _plan([])
    dp = _engine(graph, plan, "actor", True, rank=rank, world=world, group=dist.group.WORLD)
    fn, batch = _trained_and_saved(dp, graph, plan, True, folder)
    staged = _engine(graph, plan, "actor", True, rank=rank, world=world, group=dist.group.WORLD, pp=2)
    staged.load_state(folder)
    dp.train(fn, batch, _step(plan.config.algo, "ppo", 3)[1])
    staged.train(fn, batch, _step(plan.config.algo, "ppo", 3)[1])
    a, b = dp.export_weights(), staged.export_weights()
    return {
        "next_step": _close(a, b),
        "copies_equal": _same_bits({"w": b["model.embed_tokens.weight"]}, {"w": b["lm_head.weight"]}),
    }


def _stored(folder: Path) -> dict:
    """What the checkpoint's HF files say of the LM head: stored as its own tensor, and tied in the config."""
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as fh:
        keys = set(fh.keys())
    config = json.loads((folder / "config.json").read_text())
    return {"head_stored": "lm_head.weight" in keys, "tie_word_embeddings": bool(config.get("tie_word_embeddings"))}


def bf16_step(rank: int, world: int) -> dict:
    """A bfloat16 pp=2 train step that computes its own old log-probs (the sampler's beside them: the gap)
    and one process's: their stats. (In bfloat16 torch infers the stages' shapes, calling the loss once
    on placeholder activations, which must count for nothing.)"""
    import dataclasses

    import torch.distributed as dist

    from flowrl.contract.data import StepBatch
    from flowrl.tasks.builtin import Copy

    graph, plan = _plan(["train.dtype=bfloat16"])
    whole = _engine(graph, plan, "actor")
    staged = _engine(graph, plan, "actor", rank=rank, world=world, group=dist.group.WORLD, pp=2)
    prompts = Copy().prompts(random.Random(0), 5)
    rollout = whole.generate(prompts, n=3, greedy=False, generator=torch.Generator().manual_seed(0))
    seqs = rollout.sequences
    versions = torch.full_like(seqs.response_ids, whole.version) * seqs.response_mask.long()
    seqs = seqs.replaced(logprobs=rollout.logprobs, versions=versions)
    batch = StepBatch(columns=_batch(seqs, rollout.logprobs, rollout.logprobs))
    out = {}
    for name, engine in (("whole", whole), ("staged", staged)):
        fn, step = _step(plan.config.algo, "ppo", 4)
        step = dataclasses.replace(step, own=("old_logprobs",), mini_batches=1)  # the gap before any update
        stats = engine.train(fn, batch, step)
        out[name] = {k: stats[k] for k in ("loss", "grad_norm", "pad_frac", "logprob_gap", "logprob_gap_max")}
    return out


def _same_bits(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def main(rank: int, port: int, out: str, world: int) -> None:
    import torch.distributed as dist

    from flowrl.runtime.compute import on_compute_thread

    torch.set_num_threads(1)  # and on the engine's compute thread (a forked rank keeps its parent's count)
    on_compute_thread(torch.set_num_threads, 1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results = {layout: compare(rank, world, layout) for layout in LAYOUTS[world]}
    if world == 2:
        results["resume"] = resumed(rank, world, Path(out).with_name("ckpt-pp2"))
        results["resume-tied"] = resumed(rank, world, Path(out).with_name("ckpt-pp2-tied"), tied=True)
        results["resume-from-dp2-tied"] = resumed_from_dp(rank, world, Path(out).with_name("ckpt-dp2-tied"))
        results["bf16"] = bf16_step(rank, world)
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(results, fh)
    dist.destroy_process_group()


def run(rank: int, port: int, out: str, world: int) -> None:
    """`main`, a failure's traceback written to ``rank-RANK.err`` beside ``out`` (what the test reports)."""
    import traceback

    try:
        main(rank, port, out, world)
    except BaseException:
        Path(out).with_name(f"rank-{rank}.err").write_text(traceback.format_exc())
        raise


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
