"""What checkpoints cost: the same seeded GRPO run with a checkpoint only at the end, every 10
steps and every step, side by side in one process; then a resume that adds one step.

For each setting: the run's wall-clock, its ratio to the end-only run, the seconds one
checkpoint adds (the difference over the extra checkpoints), and a checkpoint's size on disk.
The resumed run's metrics before the resume point equal the run's (checked). The model is the
tiny default, or a bigger one (``--hidden``, ``--layers``) so that writing weights and optimizer
state matters. Each checkpoint write is also timed directly and set against the median step:
on a shared box the wall-clock ratios are within noise. The last line is JSON.

    python benchmarks/checkpoint.py --steps 40 --hidden 256 --layers 4
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from flowrl import api
from flowrl.contract.plan import load_plan
from flowrl.runtime import checkpoint, runstate

WRITES: list[float] = []  # seconds of each checkpoint write (runstate.write, timed below)


def _timed_write() -> None:
    original = runstate.write

    def write(*args, **kwargs):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            WRITES.append(time.perf_counter() - start)

    runstate.write = write


def _run(steps: int, every: int, out: Path, extra: list[str], name: str) -> tuple[float, Path]:
    sets = ["progress=false", f"save_every={every}", f"out={out}", f"name={name}", *extra]
    graph, plan = api.plan("grpo", overrides=sets, flags={"steps": steps}, emit=lambda s: None)
    start = time.perf_counter()
    result = api.run(graph, plan)
    return time.perf_counter() - start, result.out_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--hidden", type=int, default=None, help="tiny_model.hidden_size (default: the tiny default)")
    ap.add_argument("--layers", type=int, default=None, help="tiny_model.num_layers")
    ap.add_argument("--prompts", type=int, default=8, help="rollout.prompts_per_step")
    args = ap.parse_args()
    extra = [f"rollout.prompts_per_step={args.prompts}"]
    if args.hidden:
        extra += [f"tiny_model.hidden_size={args.hidden}", f"tiny_model.intermediate_size={4 * args.hidden}"]
    if args.layers:
        extra.append(f"tiny_model.num_layers={args.layers}")
    _timed_write()
    root = Path(tempfile.mkdtemp(prefix="flowrl-ckpt-"))
    try:
        rows = {}
        for every in (0, 10, 1):
            WRITES.clear()
            seconds, folder = _run(args.steps, every, root, extra, f"every{every}")
            steps_s = [json.loads(line)["step_seconds"] for line in (folder / "metrics.jsonl").open()]
            written = args.steps if every == 1 else (args.steps // every if every else 1)
            newest = checkpoint.latest(folder)
            assert newest is not None
            size = sum(p.stat().st_size for p in newest[1].rglob("*") if p.is_file())
            rows[every] = {
                "seconds": round(seconds, 3),
                "checkpoints": written,
                "bytes": size,
                "folder": folder,
                "write_s": statistics.median(WRITES),
                "step_s": statistics.median(steps_s),
            }
            print(
                f"save_every={every:<3} {seconds:7.2f} s  {written:3d} checkpoints of {size / 1e6:.1f} MB, "
                f"median write {rows[every]['write_s']:.3f} s, median step {rows[every]['step_s']:.3f} s"
            )
        base = rows[0]["seconds"]
        for every in (10, 1):
            extra_ckpts = rows[every]["checkpoints"] - 1
            rows[every]["ratio"] = round(rows[every]["seconds"] / base, 3)
            rows[every]["seconds_per_checkpoint"] = round((rows[every]["seconds"] - base) / max(extra_ckpts, 1), 4)
        # the wall-clock ratios are noisy at this size: the direct measure is a write against a step
        # resume: one more step on top of the every-10 run
        folder = rows[10]["folder"]
        before = (folder / "metrics.jsonl").read_text().splitlines()
        plan = load_plan(folder / "plan.yaml")
        import msgspec

        plan = msgspec.structs.replace(plan, config=msgspec.structs.replace(plan.config, steps=args.steps + 1))
        plan = msgspec.structs.replace(plan, id=plan.content_id())
        graph = api.graph_for_plan(plan)
        start = time.perf_counter()
        api.run(graph, plan, out_dir=folder, resume=True)
        resume_s = time.perf_counter() - start
        after = (folder / "metrics.jsonl").read_text().splitlines()
        assert after[: len(before)] == before and len(after) == len(before) + 1
        print(f"resume + 1 step: {resume_s:.2f} s")
        summary = {
            "bench": "checkpoint",
            "steps": args.steps,
            "hidden": args.hidden,
            "layers": args.layers,
            "checkpoint_mb": round(rows[1]["bytes"] / 1e6, 2),
            "every10_ratio": rows[10]["ratio"],
            "every1_ratio": rows[1]["ratio"],
            "seconds_per_checkpoint": rows[1]["seconds_per_checkpoint"],
            "median_write_s": round(rows[1]["write_s"], 4),
            "median_step_s": round(rows[1]["step_s"], 4),
            "write_over_step": round(rows[1]["write_s"] / rows[1]["step_s"], 3),
            "resume_plus_one_step_s": round(resume_s, 3),
            "end_only_s": base,
        }
        print(json.dumps(summary))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
