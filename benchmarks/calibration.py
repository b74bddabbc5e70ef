"""Calibration from traces: fit the cost model to two runs, predict four other plans of the same cluster.

On this machine as ``cpu:2`` (Ray, one session for all runs; `flowrl profile`'s measurement cut
in two, as `--cluster cpu:2` does), runs six plans for real (fixed-length responses), then fits the
cost model to the traces of the first two (`flowrl calibrate`'s fit) and re-predicts the other
four with the fitted factors. Prints each plan's predicted s/iteration before (the profile alone)
and after the fit beside the measured one (`traces.read_run`: the median gap between iterations
after warm-up), and a final JSON line with the median and max errors before and after.

    python benchmarks/calibration.py [--steps 10] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

# (name, graph, placement, weight sync, required layouts, extra settings); the first two calibrate
VARIANTS = [
    ("grpo colocate", "graphs/grpo.py", "colocate", "reshard", (), ()),
    ("ppo split", "graphs/ppo.py", "split", "reshard", (), ()),
    ("grpo standalone", "graphs/grpo.py", "standalone", "reshard", (), ()),
    (
        "grpo disaggregated one-step-off",
        "graphs/grpo.py",
        "disaggregated",
        "bucketed",
        (),
        ("rollout.mode=one_step_off",),
    ),
    ("grpo colocate tp2", "graphs/grpo.py", "colocate", "reshard", ("actor.tp=2",), ()),
    ("ppo colocate", "graphs/ppo.py", "colocate", "reshard", (), ()),
]
CALIBRATE_ON = 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--out", default=None, help="where the runs go (default: a temporary folder)")
    args = parser.parse_args()
    import ray
    from cpu2 import run_variant, start

    from flowrl.planner.calibrate import fit, read_runs
    from flowrl.plugins.manager import registry

    tmp, _hw, cluster = start(args.out, "flowrl-calibration-")
    os.environ["FLOWRL_HOME"] = str(tmp / "home")  # no calibration of the user's own is read or written
    runs = []
    try:
        for name, graph_src, placement, sync, require, settings in VARIANTS:
            plan, result = run_variant(
                name,
                graph_src,
                cluster,
                tmp,
                steps=args.steps,
                max_new_tokens=args.max_new_tokens,
                placement=placement,
                sync=sync,
                require=require,
                overrides=settings,
            )
            runs.append((name, str(result.out_dir), plan.layout.summary()))
            print(f"ran {name:<30} {plan.layout.summary()}", flush=True)
    finally:
        ray.shutdown()
    replays = read_runs([run for _, run, _ in runs], registry())
    fitted = fit(replays[:CALIBRATE_ON], progress=lambda s: print(f"  {s}", flush=True))
    rows = []
    for (name, _run, summary), replay in zip(runs, replays):
        measured = replay.measured.iteration_s
        before = replay.measured.plan.layout.predicted.iteration_s
        after = replay.predict(fitted.hardware).iteration_s
        role = "calibrates" if len(rows) < CALIBRATE_ON else "predicted"
        rows.append(
            {
                "variant": name,
                "role": role,
                "plan": summary,
                "measured_s": round(measured, 4),
                "before_s": round(before, 4),
                "after_s": round(after, 4),
                "error_before": round(before / measured - 1, 3),
                "error_after": round(after / measured - 1, 3),
            }
        )
        print(
            f"{name:<30} {role:<10} measured {measured:6.3f} s  before {before:6.3f} s ({before / measured - 1:+.0%})"
            f"  after {after:6.3f} s ({after / measured - 1:+.0%})",
            flush=True,
        )
    for path, (old, new, by) in fitted.factors.items():
        print(f"  {path:<28} {old:11.4g} -> {new:11.4g}  (from {len(by)} run(s))")
    held = [r for r in rows if r["role"] == "predicted"]
    before = [abs(r["error_before"]) for r in held]
    after = [abs(r["error_after"]) for r in held]
    print(
        json.dumps(
            {
                "benchmark": "calibration",
                "cluster": cluster.label,
                "calibrated_on": [r["variant"] for r in rows if r["role"] == "calibrates"],
                "predicted": len(held),
                "median_abs_error_before": round(statistics.median(before), 3),
                "max_abs_error_before": round(max(before), 3),
                "median_abs_error_after": round(statistics.median(after), 3),
                "max_abs_error_after": round(max(after), 3),
                "factors": {k: round(v[1], 9) for k, v in fitted.factors.items()},
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
