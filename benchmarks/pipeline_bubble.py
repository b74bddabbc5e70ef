"""Pipeline bubble, stage imbalance and activations in flight: the planner's prediction beside a measured
pipelined train step of the tiny GRPO job's actor, split pp=2 on Ray ``cpu:2``, for each schedule the torch
engine runs (GPipe, 1F1B, interleaved 1F1B with 2 stages per rank).

For each schedule, the job is planned for ``cpu:2`` with ``--require actor.pp=2 actor.schedule=S`` (the
interleaved one on the tiny model with 4 layers, which 2 ranks x 2 stages divide). Two Ray actors (one CPU
each, the two ranks of one gloo group) build the actor's torch engine in the plan's stages and take train
steps, as the plan's train node takes them (its micro-batch, mini-batches, epochs), on one batch of rollouts
of the job's shape (sampled once by the whole model; every response the full budget). Each rank measures
per step:

- its stages' compute and the step's wall time (the engine's hook, `Pipeline.times`: the schedule's forwards
  and backwards against the schedule calls' wall time); the rest is its idle share: the bubble, and its wait
  on a slower stage. The pipeline's bubble is the slowest stage's idle share;
- the peak bytes its autograd graph holds for backward (saved tensors, live, counted once per storage,
  parameters left out): its activations in flight.

The planner's numbers come from the same plan and hardware (``flowrl profile``'s measurement of this
machine, cut in two): `CostModel.pipeline` (each stage's time per micro-batch, idle share, imbalance) and
`memory.stage_activations` (what each stage holds for its micro-batches in flight).

    python benchmarks/pipeline_bubble.py [--steps 3] [--out DIR] [--run]

``--run`` also runs each plan whole through the Ray executor for ``--steps`` steps and reports its train
node's ``pp_bubble`` metric. Prints one line per schedule and stage, and a final JSON line (per schedule:
predicted, measured, and their ratios).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

GRAPH = "graphs/grpo.py"
MAX_NEW_TOKENS = 16
# name -> (schedule, extra settings)
SCHEDULES = {
    "gpipe": ("gpipe", ()),
    "1f1b": ("1f1b", ()),
    "int2": ("interleaved", ("tiny_model.num_layers=4",)),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SavedBytes:
    """Live bytes of the tensors autograd saves for backward (a ``saved_tensors_hooks`` pair), by storage,
    leaving out ``skip`` (the parameters' storages); ``peak`` the most at once."""

    def __init__(self, skip: set[int]) -> None:
        self.skip, self.refs, self.now, self.peak = skip, {}, 0, 0

    def pack(self, t: Any) -> Any:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.skip or ptr == 0:
            return t
        count, nbytes = self.refs.get(ptr, (0, storage.nbytes()))
        if count == 0:
            self.now += nbytes
            self.peak = max(self.peak, self.now)
        self.refs[ptr] = (count + 1, nbytes)
        return _Held(t, ptr, self)

    def unpack(self, held: Any) -> Any:
        return held.tensor if isinstance(held, _Held) else held

    def release(self, ptr: int) -> None:
        count, nbytes = self.refs[ptr]
        if count == 1:
            del self.refs[ptr]
            self.now -= nbytes
        else:
            self.refs[ptr] = (count - 1, nbytes)


class _Held:
    """A saved tensor, counted while autograd keeps it."""

    def __init__(self, tensor: Any, ptr: int, owner: SavedBytes) -> None:
        self.tensor, self.ptr, self.owner = tensor, ptr, owner

    def __del__(self) -> None:
        self.owner.release(self.ptr)


def stage_actor():
    import ray

    @ray.remote(num_cpus=1)
    class Stage:
        """One rank of the pipeline: the actor's engine in its stages; train steps, measured."""

        def __init__(self, rank: int, port: int) -> None:
            import torch
            import torch.distributed as dist

            torch.set_num_threads(1)
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
            self.rank = rank

        def where(self) -> str:
            import flowrl

            return flowrl.__file__

        def measure(self, decl: Any, run: Any, layout: Any, train: dict, batch: dict, steps: int) -> dict:
            import torch
            import torch.distributed as dist

            from flowrl.algorithms.ops import LOSSES
            from flowrl.backends.local.factories import training_engine
            from flowrl.contract.protocols import EngineContext, TrainStep
            from flowrl.specs import loss_unit

            torch.manual_seed(run.seed)
            ctx = EngineContext(
                decl=decl, spec=run, device="cpu", rank=self.rank, world=2, group=dist.group.WORLD,
                tp=layout.parallel.tp, pp=layout.parallel.pp, schedule=layout.schedule,
                virtual_stages=layout.virtual_stages,
            )  # fmt: skip
            engine = training_engine(ctx)
            times = engine.pipeline.times
            captured: list[Any] = []
            reset = times.reset

            def kept() -> Any:  # the engine reads and resets its times after each step: keep them
                done = reset()
                captured.append(done)
                return done

            times.reset = kept
            fn, meta = LOSSES[train["loss"]]
            saved = SavedBytes({p.untyped_storage().data_ptr() for p in engine.module.parameters()})
            run_schedule = engine.pipeline.run

            def counted(
                *args: Any, **kwargs: Any
            ) -> Any:  # in the thread the engine computes in (hooks are per thread)
                with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
                    return run_schedule(*args, **kwargs)

            engine.pipeline.run = counted
            out = {
                "compute": [],
                "total": [],
                "calls": [],
                "saved_peak": [],
                "stages": [s.index for s in engine.pipeline.stages],
            }
            for i in range(steps + 1):  # the first step warms up (allocations, shape inference)
                step = TrainStep(
                    node="train", sequences_key="responses", output="logprobs", micro_batch=train["micro_batch"],
                    epochs=train["epochs"], mini_batches=train["mini_batches"], algo=train["algo"],
                    generator=torch.Generator().manual_seed(i), unit=loss_unit(meta["aggregate"], train["algo"]),
                )  # fmt: skip
                saved.peak = saved.now
                engine.train(fn, batch, step)
                if i:
                    t = captured[-1]
                    out["compute"].append(t.compute)
                    out["total"].append(t.total)
                    out["calls"].append(t.calls)
                    out["saved_peak"].append(saved.peak)
            return out

        def close(self) -> None:
            import torch.distributed as dist

            dist.destroy_process_group()

    return Stage


def rollouts(decl: Any, run: Any, cfg: Any) -> dict:
    """One batch of the job's shape: ``prompts_per_step`` copy-task prompts x ``samples_per_prompt``
    responses, sampled by the whole model, each counted to the full budget, and the columns GRPO's loss
    reads."""
    import random

    import torch

    from flowrl.backends.local.factories import training_engine
    from flowrl.contract.protocols import EngineContext
    from flowrl.tasks.builtin import Copy

    torch.manual_seed(run.seed)
    whole = training_engine(EngineContext(decl=decl, spec=run, device="cpu"))
    prompts = Copy().prompts(random.Random(0), cfg.rollout.prompts_per_step)
    seqs = whole.generate(
        prompts, n=cfg.rollout.samples_per_prompt, greedy=False, generator=torch.Generator().manual_seed(0)
    ).sequences
    seqs = seqs.replaced(response_mask=torch.ones_like(seqs.response_mask))
    logp = whole.forward(seqs, "logprobs", 64)
    noise = torch.Generator().manual_seed(1)
    return {
        "responses": seqs,
        "old_logprobs": logp + 0.05 * torch.randn(logp.shape, generator=noise),
        "ref_logprobs": logp - 0.01,
        "advantages": torch.randn(len(seqs), 1, generator=noise) * seqs.response_mask,
    }


def predict(plan: Any, node: Any, seq_len: int) -> dict:
    """The planner's pipeline terms for the plan's actor train step: per stage its time per micro-batch, its
    share of the step not computing (idle, sending, receiving: as the engine's hook measures) and held
    activation bytes; the bubble (the slowest stage's share not computing) and the imbalance."""
    import msgspec

    from flowrl.planner import memory as mem
    from flowrl.planner.cost import CostModel

    t, cfg = plan.target, plan.config
    lay = msgspec.structs.replace(plan.layout.layout("actor"), micro_batch=node.micro_batch_size)
    spec = t.spec("actor")
    cost = CostModel(spec, t.cluster.hardware)
    pc = cost.pipeline(lay, node.rows, seq_len, backward=True, mini_batches=cfg.train.mini_batches)
    held = [
        h for h, _ in mem.stage_activations(spec, t.numerics, lay, seq_len, training=True, micro_steps=pc.micro_batches)
    ]
    return {
        "micro_batches": pc.micro_batches,
        "steps": pc.steps,
        "stage_s": list(pc.compute),  # computing, as the engine's hook times it (its sends apart)
        "idle": pc.not_computing,  # sends and receives included, as the engine's hook counts them
        "bubble": min(pc.not_computing),  # the slowest stage's
        "imbalance": pc.imbalance,
        "step_s": pc.seconds * cfg.train.epochs,
        "held_bytes": held,
    }


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="measured train steps per schedule (after one warm-up)")
    parser.add_argument("--out", default=None, help="folder for the profile and runs (default: a temporary one)")
    parser.add_argument("--run", action="store_true", help="also run each plan whole through the Ray executor")
    args = parser.parse_args()

    import ray
    from cpu2 import plan_variant, start

    out, _hw, cluster = start(args.out, "flowrl-pipeline-")
    Stage = stage_actor()
    results: dict[str, Any] = {}
    try:
        for name, (schedule, extra) in SCHEDULES.items():
            require = ("actor.pp=2", f"actor.schedule={schedule}")
            graph, plan = plan_variant(
                f"pp2-{name}", GRAPH, cluster, Path(out), steps=args.steps, max_new_tokens=MAX_NEW_TOKENS,
                require=require, overrides=extra,
            )  # fmt: skip
            lay = plan.layout.layout("actor")
            node = next(n for n in plan.nodes if n.kind == "train" and graph.nodes[n.node].model == "actor")
            cfg = plan.config
            decl, run = graph.models["actor"], plan.model_run("actor")
            batch = rollouts(decl, run, cfg)
            seqs = batch["responses"]
            seq_len = int(seqs.input_ids.shape[1])
            train = {
                "loss": graph.nodes[node.node].loss,
                "algo": cfg.algo,
                "micro_batch": node.micro_batch_size,
                "epochs": cfg.train.epochs,
                "mini_batches": cfg.train.mini_batches,
            }
            port = _free_port()
            ranks = [Stage.remote(r, port) for r in range(2)]
            where = ray.get([r.where.remote() for r in ranks])
            got = ray.get([r.measure.remote(decl, run, lay, train, batch, args.steps) for r in ranks])
            ray.get([r.close.remote() for r in ranks])
            for r in ranks:
                ray.kill(r)
            pred = predict(plan, node, seq_len)
            compute = [statistics.median(g["compute"]) for g in got]
            total = [statistics.median(g["total"]) for g in got]
            idle = [1 - c / t for c, t in zip(compute, total)]
            per_step = pred["micro_batches"] * pred["steps"] * cfg.train.epochs  # micro-batches a rank computes
            measured = {
                "stage_s": [c / per_step for c in compute],
                "idle": idle,
                "bubble": min(idle),
                "imbalance": max(compute) * len(compute) / sum(compute),
                "step_s": max(total),
                "held_bytes": [max(g["saved_peak"]) for g in got],
            }
            row = {
                "summary": plan.layout.summary().split(" | ")[0],
                "micro_batch": node.micro_batch_size,
                "micro_batches": pred["micro_batches"],
                "rows": node.rows,
                "seq_len": seq_len,
                "predicted": pred,
                "measured": measured,
                "ratio": {
                    "bubble": ratio(measured["bubble"], pred["bubble"]),
                    "imbalance": ratio(measured["imbalance"], pred["imbalance"]),
                    "held_bytes": [ratio(m, p) for m, p in zip(measured["held_bytes"], pred["held_bytes"])],
                    "step_s": ratio(measured["step_s"], pred["step_s"]),
                    "stage_s": [ratio(m, p) for m, p in zip(measured["stage_s"], pred["stage_s"])],
                },
                "workers": sorted(set(where)),
            }
            if args.run:
                from flowrl import api

                result = api.run(graph, plan)
                key = f"{node.node}/pp_bubble"
                seen = [m[key] for m in result.metrics[1:] if key in m]
                row["run"] = {"pp_bubble": statistics.median(seen) if seen else None, "metric": key}
            results[name] = row
            print(
                f"{name:5} {row['summary']}  m={pred['micro_batches']} x{pred['steps']} mb{node.micro_batch_size} "
                f"seq {seq_len}: bubble predicted {pred['bubble']:.1%} measured {measured['bubble']:.1%}; "
                f"imbalance {pred['imbalance']:.2f} vs {measured['imbalance']:.2f}; "
                f"step {pred['step_s'] * 1e3:.1f} vs {measured['step_s'] * 1e3:.1f} ms",
                flush=True,
            )
            for s in range(2):
                print(
                    f"      stage {s}: {pred['stage_s'][s] * 1e3:.2f} vs {measured['stage_s'][s] * 1e3:.2f} ms per "
                    f"micro-batch; idle {pred['idle'][s]:.1%} vs {idle[s]:.1%}; activations held "
                    f"{pred['held_bytes'][s] / 2**20:.2f} vs {measured['held_bytes'][s] / 2**20:.2f} MiB",
                    flush=True,
                )
    finally:
        ray.shutdown()
    print(json.dumps({"benchmark": "pipeline_bubble", "schedules": results}))


if __name__ == "__main__":
    main()
