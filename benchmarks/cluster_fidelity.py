"""Predicted vs measured iteration time of cluster plans run on Ray, on this machine as ``cpu:2``.

Profiles this machine (`flowrl profile`'s measurement, kept in a temporary folder), cuts it into
two devices as `--cluster cpu:2` does, and for each variant (graph, pinned placement and
weight-sync strategy) plans with the planner, runs the plan for real on the Ray backend (one
Ray session for all runs), and compares the median measured step time (after warm-up) with the
plan's predicted iteration time. Every run writes trace.json (all workers' spans, for Perfetto)
and timeline.png (measured beside predicted) in its run folder. Responses have fixed lengths
(EOS ignored) so measured and simulated runs see the same lengths. The last line is JSON.

    python benchmarks/cluster_fidelity.py [--steps 10]
"""

from __future__ import annotations

import argparse
import json
import statistics

# (name, graph, placement, weight sync, required layouts)
VARIANTS = [
    ("grpo colocate reshard", "graphs/grpo.py", "colocate", "reshard", ()),
    ("grpo standalone reshard", "graphs/grpo.py", "standalone", "reshard", ()),
    ("ppo split reshard", "graphs/ppo.py", "split", "reshard", ()),
    ("grpo disaggregated full", "graphs/grpo.py", "disaggregated", "full", ()),
    ("grpo disaggregated bucketed", "graphs/grpo.py", "disaggregated", "bucketed", ()),
    ("grpo disaggregated sparse", "graphs/grpo.py", "disaggregated", "sparse", ()),
    # tensor parallel: the actor split over both devices, generating from whole replicas or in place
    ("grpo colocate tp2", "graphs/grpo.py", "colocate", "reshard", ("actor.tp=2",)),
    ("grpo colocate tp2 gen tp2", "graphs/grpo.py", "colocate", "reshard", ("actor.tp=2", "generation.tp=2")),
    ("grpo colocate dp2 gen tp2", "graphs/grpo.py", "colocate", "reshard", ("actor.dp=2", "generation.tp=2")),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--only", action="append", default=[], help="run only variants whose name contains this")
    parser.add_argument("--out", default=None, help="where the runs go (default: a temporary folder)")
    args = parser.parse_args()
    import ray
    from cpu2 import run_variant, start

    tmp, hw, cluster = start(args.out, "flowrl-cluster-fidelity-")
    rows = []
    try:
        for name, graph_src, placement, sync, require in VARIANTS:
            if args.only and not any(o in name for o in args.only):
                continue
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
            )
            steps = result.metrics[2:] or result.metrics
            measured = statistics.median(m["step_seconds"] for m in steps)
            predicted = plan.layout.predicted.iteration_s
            spans = {k: round(statistics.median(m["spans"][k] for m in steps), 4) for k in steps[0]["spans"]}
            row = {
                "variant": name,
                "plan": plan.layout.summary(),
                "measured_s": round(measured, 4),
                "predicted_s": round(predicted, 4),
                "error": round(predicted / measured - 1, 3),
                "measured_spans": spans,
                "predicted_breakdown": {k: round(v, 4) for k, v in plan.layout.predicted.breakdown.items()},
                "run": str(result.out_dir),
            }
            rows.append(row)
            print(
                f"{name:<30} measured {measured:6.3f} s  predicted {predicted:6.3f} s  error {row['error']:+.0%}"
                f"   ({result.out_dir}/timeline.png)",
                flush=True,
            )
    finally:
        ray.shutdown()
    errors = [abs(r["error"]) for r in rows]
    print(
        json.dumps(
            {
                "benchmark": "cluster_fidelity",
                "cluster": cluster.label,
                "plans": len(rows),
                "median_abs_error": round(statistics.median(errors), 3),
                "max_abs_error": round(max(errors), 3),
                "hardware": {
                    "peak_gflops_per_device": round(cluster.hardware.peak_flops_fp32 / 1e9, 1),
                    "matmul_efficiency": round(hw.matmul_efficiency, 3),
                    "kernel_overhead_us": round(hw.kernel_overhead * 1e6, 1),
                },
                "rows": [{k: r[k] for k in ("variant", "measured_s", "predicted_s", "error")} for r in rows],
            }
        )
    )


if __name__ == "__main__":
    main()
