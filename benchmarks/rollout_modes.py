"""Rollout modes side by side on this machine as ``cpu:2`` (Ray): what each buys on a long tail.

For each task (the long-tailed ``repeat`` and a heavier-tailed variant of it) and each rollout
mode (sync, one-step-off, async eta = 1 and 2, partial, partial + async, streaming), this plans
GRPO with the tuner for the mode (``--set rollout.mode=...``: the tuner picks placement, sizes
and weight sync), runs the plan for real on the Ray backend with the same model, samples per
step and seed (``--seeds N``: N runs per mode, seeds 0..N-1, their means reported), and reports:

- samples/s over the whole run (trained samples / wall-clock of all steps),
- wall-clock until the reward (mean over a trailing window of 5 steps) first reaches 0.8 (per seed, and
  the mean where every seed got there),
- final reward (mean of the last 10 % of steps),
- the plan's predicted iteration time beside the measured one (median step time over the
  second half of the run, when responses have the trained policy's lengths the planner
  plans with), and whether the predicted ranking of the modes matches the measured one.

With ``--trl PYTHON`` it also runs ``benchmarks/trl_grpo.py`` (TRL's GRPOTrainer, same task,
model, sizes, learning rate, KL and clip settings) with that interpreter and reports the best
flowrl mode's samples/s over TRL's. The machine is profiled first (``flowrl profile``'s
measurement) so the planner predicts for this CPU. The last line is JSON.

    python benchmarks/rollout_modes.py [--steps 120] [--seeds 1] [--trl /work/trl-venv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from cpu2 import settings, start, summarise

HERE = Path(__file__).resolve().parent
MODES = [
    ("sync", "sync", None),
    ("one_step_off", "one_step_off", None),
    ("async eta=1", "async", 1),
    ("async eta=2", "async", 2),
    ("partial", "partial", None),
    ("partial+async", "partial+async", None),
    ("streaming", "streaming", None),
]
TASKS = {
    "repeat": {},
    "repeat-heavy": {"sigma": 1.0, "max_count": 32},  # a heavier length tail: p99 ~ 4x the p50 of repeat
}
TARGET = 0.8


def run_trl(python: str, task: str, options: dict, args: argparse.Namespace) -> dict:
    cmd = [
        python,
        str(HERE / "trl_grpo.py"),
        "--task",
        "repeat",
        *[x for k, v in options.items() for x in ("--task-option", f"{k}={v}")],
        "--prompts",
        str(args.prompts),
        "--samples",
        str(args.samples),
        "--eos",
        "--lr",
        "2e-3",
        "--beta",
        "0.05",
        "--epsilon",
        "0.2",
        "--epsilon-high",
        "0.28",
        "--mini-batches",
        "2",
        "--steps",
        str(args.steps),
        "--threads",
        "1",
        "--target-reward",
        str(TARGET),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        sys.exit(f"trl_grpo.py failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    out = json.loads(lines[-1])
    return {k: out[k] for k in ("samples_per_s", "seconds_to_target", "final_reward", "median_step_s", "total_s")}


def pooled(summaries: list[dict]) -> dict:
    """One mode's runs (a seed each) as one row: means of samples/s, final reward and median step time; the time
    to target per seed, and its mean where every seed got there (None otherwise)."""
    times = [s["seconds_to_target"] for s in summaries]
    return {
        "samples_per_s": round(statistics.mean(s["samples_per_s"] for s in summaries), 1),
        "seconds_to_target": None if None in times else round(statistics.mean(times), 2),
        "seconds_to_target_each": times,
        "final_reward": round(statistics.mean(s["final_reward"] for s in summaries), 4),
        "final_reward_each": [s["final_reward"] for s in summaries],
        "measured_s": round(statistics.mean(s["measured_s"] for s in summaries), 4),
    }


def ranking(rows: list[dict], key: str) -> list[str]:
    return [r["mode"] for r in sorted(rows, key=lambda r: r[key])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--tasks", nargs="*", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--modes", nargs="*", default=[m for m, _, _ in MODES], help="modes to run (default: all)")
    parser.add_argument("--trl", default=None, help="a Python with TRL installed: also run benchmarks/trl_grpo.py")
    parser.add_argument("--out", default=None, help="where the runs go (default: a temporary folder)")
    parser.add_argument(
        "--seeds", type=int, default=1, help="runs per mode, seeds 0..N-1 (times to target and rewards are their means)"
    )
    args = parser.parse_args()
    import ray

    from flowrl import api
    from flowrl.contract.plan import ClusterTarget

    tmp, hw, cluster = start(args.out, "flowrl-rollout-modes-")
    samples_per_step = args.prompts * args.samples
    results: dict[str, dict] = {}
    try:
        for task_name in args.tasks:
            options = TASKS[task_name]
            rows = []
            for name, mode, eta in MODES:
                if name not in args.modes:
                    continue
                runs = []
                for seed in range(args.seeds):
                    overrides = settings(
                        args.steps,
                        tmp,
                        f"{task_name}-{name.replace(' ', '-').replace('=', '')}-seed{seed}",
                        "task=repeat",
                        *[f"task_options.{k}={v}" for k, v in options.items()],
                        f"rollout.prompts_per_step={args.prompts}",
                        f"rollout.samples_per_prompt={args.samples}",
                        f"rollout.mode={mode}",
                        *([f"rollout.staleness={eta}"] if eta is not None else []),
                        f"seed={seed}",
                    )
                    _, cfg = api.load("graphs/grpo.py", overrides=overrides)
                    target = ClusterTarget(cluster=cluster, model=api.model_spec(cfg))
                    graph, plan = api.plan(
                        "graphs/grpo.py", overrides=overrides, target=target, for_backend=True, emit=lambda s: None
                    )
                    result = api.run(graph, plan)
                    runs.append((plan, result, summarise(result.metrics, samples_per_step, TARGET)))
                row = {"mode": name, "plan": runs[0][0].layout.summary(), **pooled([r[2] for r in runs])}
                row["predicted_s"] = round(statistics.mean(r[0].layout.predicted.iteration_s for r in runs), 4)
                row["runs"] = [str(r[1].out_dir) for r in runs]
                row["error"] = round(row["predicted_s"] / row["measured_s"] - 1, 3)
                rows.append(row)
                print(
                    f"{task_name:<13} {name:<14} {row['samples_per_s']:7.1f} samples/s  to {TARGET}: "
                    f"{row['seconds_to_target']} s {row['seconds_to_target_each']}  final {row['final_reward']:.3f}  "
                    "step measured "
                    f"{row['measured_s']:.3f} s predicted {row['predicted_s']:.3f} s ({row['error']:+.0%})  "
                    f"[{row['plan']}]",
                    flush=True,
                )
            sync = next(r for r in rows if r["mode"] == "sync")
            for r in rows:
                r["speedup"] = round(r["samples_per_s"] / sync["samples_per_s"], 3)
            best = max(rows, key=lambda r: r["samples_per_s"])
            entry = {
                "best": best["mode"],
                "best_speedup": best["speedup"],
                "best_reaches_target_no_later": best["seconds_to_target"] is not None
                and (sync["seconds_to_target"] is None or best["seconds_to_target"] <= sync["seconds_to_target"]),
                "best_final_reward_gap": round(best["final_reward"] - sync["final_reward"], 4),
                "predicted_ranking": ranking(rows, "predicted_s"),
                "measured_ranking": ranking(rows, "measured_s"),
                "median_abs_error": round(statistics.median(abs(r["error"]) for r in rows), 3),
                "max_abs_error": round(max(abs(r["error"]) for r in rows), 3),
                "modes": {
                    r["mode"]: {
                        k: r[k]
                        for k in (
                            "speedup",
                            "samples_per_s",
                            "seconds_to_target",
                            "seconds_to_target_each",
                            "final_reward",
                            "final_reward_each",
                            "measured_s",
                            "predicted_s",
                            "error",
                        )
                    }
                    for r in rows
                },
            }
            entry["ranking_matches"] = entry["predicted_ranking"] == entry["measured_ranking"]
            entry["best_predicted_is_best_measured"] = entry["predicted_ranking"][0] == entry["measured_ranking"][0]
            if args.trl:
                trl = run_trl(args.trl, task_name, options, args)
                entry["trl"] = trl
                entry["best_over_trl_samples_per_s"] = round(best["samples_per_s"] / trl["samples_per_s"], 3)
                print(f"{task_name:<13} TRL            {trl}", flush=True)
            results[task_name] = entry
    finally:
        ray.shutdown()
    print(
        json.dumps(
            {
                "benchmark": "rollout_modes",
                "cluster": cluster.label,
                "steps": args.steps,
                "samples_per_step": samples_per_step,
                "tasks": results,
            }
        )
    )


if __name__ == "__main__":
    main()
