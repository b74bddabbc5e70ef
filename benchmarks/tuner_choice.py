"""The tuner's choice checked by execution: is its pick the fastest to a target reward on this machine?

On this machine as ``cpu:2`` (two Ray devices, profiled first as `flowrl profile` does), the tuner plans GRPO
on the ``repeat`` task (learnable from scratch in about 100 steps) and ranks its candidates by
``--objective``. As a user would, it first calibrates: the profiled ranking's candidates run ``--calibrate-
steps`` steps each, `flowrl calibrate`'s fit moves the cost model's factors to what those short runs measured,
and the tuner ranks again on the fitted hardware (the JSON line's ``calibration`` has each short run's
predicted s/iteration as profiled and as calibrated beside the measured one). The judged runs below are runs
of their own, not the short ones. The first ``--top`` candidates of distinct shapes (placement, parallelism,
generation layout, rollout policy or weight sync differ; the best micro-batch and offload of each shape;
``--distinct plan`` counts those too; `flowrl.api.plan_ranked` writes each as the plan the tuner would have
returned had it won) each run ``--repeats`` times for real with the same model, seed and samples per step.
Runs go round-robin (every candidate once, then again) so a load that drifts on a shared machine falls on all
alike. A plan ranked under both objectives runs once for both.

Per candidate it reports the predicted seconds per iteration and time to target (the plan's
``objective`` record: seconds per iteration x the iterations its rollout policy needs, from
``--target-steps``) beside the measured wall-clock until the reward (trailing mean over 5 steps)
first reaches ``--target`` (each repeat), the steps that took, and samples/s over the whole run.
The noise is the largest spread (max - min) between one candidate's repeats; the pick (rank 1) was
the fastest when its mean time to target is at most the best other candidate's mean + the noise. A
candidate with a repeat that never reached the target counts as slower than any that did; when no
candidate reached it the verdict is null. Progress lines while it runs, then a table and one JSON
line per objective (the last lines).

    python benchmarks/tuner_choice.py [--objective both|throughput|time-to-target] [--top 3] [--repeats 2]
                                      [--steps 120] [--target 0.8] [--target-steps N] [--out DIR]
                                      [--calibrate-steps 15]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cpu2 import WINDOW, reaching, settings, start, summarise

OBJECTIVES = ("throughput", "time-to-target")
GRAPH = "graphs/grpo.py"


def candidate_plans(
    cluster: Any,
    out: Path,
    *,
    objective: str,
    top: int,
    steps: int,
    prompts: int,
    samples: int,
    target_steps: int | None = None,
    extra: tuple[str, ...] = (),
    shapes: bool = True,
) -> tuple[Any, list[Any]]:
    """(graph, plans): GRPO on ``repeat`` planned for ``cluster`` on Ray, one plan per tuner candidate of the
    first ``top`` distinct ones under ``objective`` (``shapes``: of distinct shapes, the best of each), best
    first. ``extra``: more ``--set`` overrides."""
    from flowrl import api
    from flowrl.contract.plan import ClusterTarget

    overrides = settings(
        steps,
        out,
        "tuner-choice",
        "task=repeat",
        f"rollout.prompts_per_step={prompts}",
        f"rollout.samples_per_prompt={samples}",
        *extra,
    )
    _, cfg = api.load(GRAPH, overrides=overrides)
    target = ClusterTarget(cluster=cluster, model=api.model_spec(cfg))
    options = {"objective": objective, "target_steps": target_steps}
    return api.plan_ranked(
        GRAPH,
        top=top,
        overrides=overrides,
        target=target,
        for_backend=True,
        options=options,
        shapes=shapes,
        emit=lambda s: None,
    )


def measure(
    graph: Any,
    plans: dict[str, Any],
    out: Path,
    *,
    repeats: int,
    target: float,
    folder: str = "runs",
    emit: Callable[[str], None] = print,
) -> dict[str, list[dict]]:
    """Run each plan (by key) ``repeats`` times, round-robin, into ``out/FOLDER/KEY-repN``. Returns per key one
    record per repeat: the run folder, seconds and steps to ``target``, samples/s, final reward."""
    from flowrl import api
    from flowrl.runtime.executor import run_dir

    runs: dict[str, list[dict]] = {key: [] for key in plans}
    total, done = repeats * len(plans), 0
    for rep in range(repeats):
        for key, plan in plans.items():
            done += 1
            emit(f"[{done}/{total}] running {key} repeat {rep + 1}: {plan.layout.summary()}")
            result = api.run(graph, plan, out_dir=run_dir(str(out / folder), f"{key}-rep{rep + 1}"))
            samples_per_step = plan.workload.sequences
            summary = summarise(result.metrics, samples_per_step, target)
            reached = reaching(result.metrics, target)
            record = {
                "run": str(result.out_dir),
                "s_to_target": None if reached is None else reached[1],
                "steps_to_target": None if reached is None else reached[0],
                "samples_per_s": summary["samples_per_s"],
                "final_reward": summary["final_reward"],
                "total_s": summary["total_s"],
            }
            runs[key].append(record)
            reach = ""
            if math.isfinite(target):
                reach = f"to {target}: {record['s_to_target']} s (step {record['steps_to_target']}), "
            emit(
                f"    {key} repeat {rep + 1}: {reach}{record['samples_per_s']} samples/s, "
                f"final reward {record['final_reward']}, {record['total_s']} s in all"
            )
    return runs


def calibrate(
    cluster: Any,
    out: Path,
    *,
    steps: int,
    objectives: tuple[str, ...],
    emit: Callable[[str], None] = print,
    **ranking: Any,
) -> tuple[Any, dict]:
    """Short runs (``steps`` steps each, into ``out/calibration``) of the tuner's first candidates as the machine's
    profile ranks them, and the cluster's hardware fitted to what they measured, as `flowrl calibrate` fits it
    (`flowrl.planner.calibrate.fit`): the calibrated cluster and a record of the fit. ``ranking``: the arguments
    of `candidate_plans` other than the objective and steps."""
    import msgspec

    from flowrl.planner.calibrate import fit, read_runs
    from flowrl.plugins.manager import registry

    graph, plans = None, {}
    for objective in objectives:
        graph, found = candidate_plans(cluster, out, objective=objective, steps=steps, **ranking)
        for plan in found:
            plans.setdefault(plan.layout.summary(), plan)
    keyed = {f"calibration{i}": plan for i, plan in enumerate(plans.values(), 1)}  # not the judged planN
    emit(f"calibration: {len(keyed)} run(s) of {steps} steps, the profiled tuner's first candidates")
    runs = measure(graph, keyed, out, repeats=1, target=math.inf, folder="calibration", emit=emit)
    replays = read_runs([records[0]["run"] for records in runs.values()], registry())
    result = fit(replays, progress=lambda line: emit(f"  {line}"))
    record: dict[str, Any] = {"steps": steps, "runs": []}
    for key, records in runs.items():
        run = records[0]["run"]
        before, after, measured = result.before[run], result.after[run], result.measured[run]
        emit(
            f"  {key}: predicted {before:.3f} s/iteration as profiled, {after:.3f} calibrated, measured "
            f"{measured:.3f}  {keyed[key].layout.summary()}"
        )
        record["runs"].append(
            {
                "plan": keyed[key].layout.summary(),
                "run": run,
                "measured_s_per_iter": round(measured, 4),
                "predicted_profiled": round(before, 4),
                "predicted_calibrated": round(after, 4),
            }
        )
    record["factors"] = {path: [before, after] for path, (before, after, _) in result.factors.items()}
    return msgspec.structs.replace(cluster, hardware=result.hardware), record


def verdict(candidates: list[dict]) -> dict:
    """Whether the first candidate (the pick) was the fastest to the target within the noise, from the
    candidates' measured ``measured_s_to_target`` (one entry per repeat; None: that repeat never got there).
    Returns pick_was_fastest (None when no candidate reached the target), noise_s (the largest spread
    between one candidate's repeats), the pick's and the best other's mean, and the measured fastest's rank."""
    spreads = [max(t) - min(t) for c in candidates if (t := c["measured_s_to_target"]) and None not in t]
    noise = round(max(spreads, default=0.0), 2)
    means = {c["rank"]: mean_time(c) for c in candidates}
    reached = {rank: m for rank, m in means.items() if m is not None}
    pick = candidates[0]["rank"]
    others = [m for rank, m in reached.items() if rank != pick]
    best_other = min(others, default=None)
    if not reached:
        fastest, won = None, None
    else:
        fastest = min(reached, key=lambda rank: (reached[rank], rank))
        if means[pick] is None:
            won = False
        else:
            won = best_other is None or means[pick] <= best_other + noise
    return {
        "pick_was_fastest": won,
        "noise_s": noise,
        "pick_mean_s": means[pick],
        "best_other_mean_s": best_other,
        "measured_fastest_rank": fastest,
    }


def mean_time(candidate: dict) -> float | None:
    """The mean of a candidate's repeats' seconds to target; None if a repeat never reached it."""
    times = candidate["measured_s_to_target"]
    if not times or None in times:
        return None
    return round(statistics.mean(times), 2)


def choose(
    cluster: Any,
    out: Path,
    *,
    objectives: tuple[str, ...] = OBJECTIVES,
    top: int = 3,
    repeats: int = 2,
    steps: int = 120,
    prompts: int = 32,
    samples: int = 16,
    target: float = 0.8,
    target_steps: int | None = None,
    extra: tuple[str, ...] = (),
    shapes: bool = True,
    calibrate_steps: int = 0,
    emit: Callable[[str], None] = print,
) -> list[dict]:
    """Plan under each objective, run the candidates (a plan two objectives rank runs once), and return one
    summary per objective: the JSON line's fields. ``calibrate_steps``: rank on the hardware fitted to short runs
    of the profiled ranking's candidates (`calibrate`) rather than on the profile alone."""
    ranking = dict(top=top, prompts=prompts, samples=samples, target_steps=target_steps, extra=extra, shapes=shapes)
    calibration = None
    if calibrate_steps:
        cluster, calibration = calibrate(
            cluster, out, steps=calibrate_steps, objectives=objectives, emit=emit, **ranking
        )
    graph, ranked = None, {}
    plans: dict[str, Any] = {}  # run key -> plan, one per distinct layout
    keys: dict[str, str] = {}  # layout summary -> run key
    for objective in objectives:
        graph, found = candidate_plans(cluster, out, objective=objective, steps=steps, **ranking)
        ranked[objective] = found
        emit(f"{objective}: the tuner's top {len(found)} distinct candidates")
        for rank, plan in enumerate(found, 1):
            summary = plan.layout.summary()
            if summary not in keys:
                keys[summary] = f"plan{len(keys) + 1}"
                plans[keys[summary]] = plan
            rec = plan.objective
            emit(
                f"  {rank}. {keys[summary]}: {rec.iteration_s:.3f} s/iteration, {duration(rec.time_to_target_s)} to "
                f"target predicted  {summary}"
            )
    runs = measure(graph, plans, out, repeats=repeats, target=target, emit=emit)
    results = []
    for objective, found in ranked.items():
        candidates = []
        for rank, plan in enumerate(found, 1):
            key = keys[plan.layout.summary()]
            rec = plan.objective
            candidates.append(
                {
                    "rank": rank,
                    "plan": plan.layout.summary(),
                    "predicted_s_per_iter": round(rec.iteration_s, 4),
                    "predicted_time_to_target": round(rec.time_to_target_s, 2),
                    "predicted_steps_to_target": round(rec.steps, 1),
                    "measured_s_to_target": [r["s_to_target"] for r in runs[key]],
                    "measured_steps_to_target": [r["steps_to_target"] for r in runs[key]],
                    "samples_per_s": round(statistics.mean(r["samples_per_s"] for r in runs[key]), 1),
                    "final_reward": round(statistics.mean(r["final_reward"] for r in runs[key]), 4),
                    "runs": [r["run"] for r in runs[key]],
                }
            )
        results.append(
            {
                "bench": "tuner_choice",
                "objective": objective,
                "cluster": cluster.label,
                "steps": steps,
                "samples_per_step": prompts * samples,
                "target_reward": target,
                "window": WINDOW,
                "target_steps": found[0].objective.target_steps,
                "repeats": repeats,
                "distinct": "shape" if shapes else "plan",
                "calibration": calibration,
                "candidates": candidates,
                **verdict(candidates),
            }
        )
    return results


def duration(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 600 else f"{seconds / 60:.1f} min"


def table(result: dict) -> list[str]:
    """The result of one objective as lines: one row per candidate, then the verdict."""
    lines = [
        f"objective {result['objective']}: to reward {result['target_reward']} (trailing {result['window']} steps), "
        f"{result['repeats']} repeat(s) of {result['steps']} steps, {result['samples_per_step']} samples/step",
        f"  {'rank':>4} {'pred s/it':>9} {'pred to target':>14} {'measured to target (s)':>24} {'steps':>9} "
        f"{'samples/s':>9}  plan",
    ]
    for c in result["candidates"]:
        times = ", ".join("-" if t is None else f"{t:.1f}" for t in c["measured_s_to_target"])
        steps = ",".join("-" if s is None else str(s) for s in c["measured_steps_to_target"])
        lines.append(
            f"  {c['rank']:>4} {c['predicted_s_per_iter']:9.3f} {duration(c['predicted_time_to_target']):>14} "
            f"{times:>24} {steps:>9} {c['samples_per_s']:9.1f}  {c['plan']}"
        )
    won = result["pick_was_fastest"]
    said = {True: "yes", False: "NO", None: "undecided (no candidate reached the target)"}[won]
    lines.append(
        f"  pick was the fastest to target within the noise ({result['noise_s']} s): {said}; pick "
        f"{result['pick_mean_s']} s, best other {result['best_other_mean_s']} s, measured fastest: rank "
        f"{result['measured_fastest_rank']}"
    )
    return lines


def report(results: list[dict]) -> list[str]:
    """What the benchmark prints at the end: each objective's table, then one JSON line per objective."""
    return [line for result in results for line in table(result)] + [json.dumps(result) for result in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objective", default="both", choices=["both", *OBJECTIVES])
    parser.add_argument("--top", type=int, default=3, help="distinct candidates to run (default 3)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each candidate (default 2)")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--target", type=float, default=0.8, help="target reward (trailing mean over 5 steps)")
    parser.add_argument(
        "--target-steps", type=int, default=None, help="the planner's iterations to target (default: --steps)"
    )
    parser.add_argument("--out", default=None, help="where the runs go (default: a temporary folder)")
    parser.add_argument(
        "--distinct",
        default="shape",
        choices=["shape", "plan"],
        help="candidates of distinct shapes (placement, parallelism, rollout policy, sync: the best of each; the "
        "default) or of distinct plans (also micro-batch sizes and optimizer offload)",
    )
    parser.add_argument(
        "--calibrate-steps",
        type=int,
        default=15,
        help="first run the profiled tuner's candidates this many steps each and rank on the hardware fitted to "
        "them, as `flowrl calibrate` fits it (default 15; 0: rank on the profile alone)",
    )
    args = parser.parse_args()
    if args.calibrate_steps < 0 or 0 < args.calibrate_steps < 4:
        parser.error(
            f"--calibrate-steps must be 0 or at least 4, not {args.calibrate_steps}: a calibration measures after 2 "
            "steps of warm-up"
        )
    import ray

    objectives = OBJECTIVES if args.objective == "both" else (args.objective,)
    tmp, _, cluster = start(args.out, "flowrl-tuner-choice-")
    print(f"profiled this machine; runs under {tmp / 'runs'}", flush=True)
    try:
        results = choose(
            cluster, tmp, objectives=objectives, top=args.top, repeats=args.repeats, steps=args.steps,
            prompts=args.prompts, samples=args.samples, target=args.target, target_steps=args.target_steps,
            shapes=args.distinct == "shape", calibrate_steps=args.calibrate_steps,
            emit=lambda line: print(line, flush=True),
        )  # fmt: skip
    finally:
        ray.shutdown()
    print("\n".join(report(results)))


if __name__ == "__main__":
    main()
