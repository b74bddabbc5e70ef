"""Predicted vs measured iteration time of GRPO plan variants on this machine (local backend).

Runs `flowrl profile` (fits the cost model to this machine), then for each variant runs real
GRPO steps with the local backend and simulates the same plan; prints one line per variant and
a final JSON line with the median absolute error. Responses have fixed lengths (EOS ignored) so
the measured and simulated runs see the same length distribution; partial rollouts and
staleness are not in the local runtime yet, so no variant uses them.

    python benchmarks/plan_fidelity.py [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from flowrl import api
from flowrl.backends.local.profile import profile
from flowrl.contract.plan import ClusterTarget
from flowrl.planner.hardware import ClusterSpec
from flowrl.planner.workload import Fixed, WorkloadSpec

# (name, overrides)
VARIANTS = [
    ("8x8 L16 mb-all", ["rollout.prompts_per_step=8", "rollout.samples_per_prompt=8", "rollout.max_new_tokens=16"]),
    ("32x16 L8 mb-all", ["rollout.max_new_tokens=8"]),
    ("32x16 L16 mb64", ["rollout.max_new_tokens=16", "train.micro_batch_size=64"]),
    ("32x16 L16 mb256", ["rollout.max_new_tokens=16", "train.micro_batch_size=256"]),
    ("32x16 L32 mb128", ["rollout.max_new_tokens=32", "train.micro_batch_size=128"]),
    (
        "16x8 L48 mb32",
        [
            "rollout.prompts_per_step=16",
            "rollout.samples_per_prompt=8",
            "rollout.max_new_tokens=48",
            "train.micro_batch_size=32",
        ],
    ),
    ("64x8 L12 mb-all", ["rollout.prompts_per_step=64", "rollout.samples_per_prompt=8", "rollout.max_new_tokens=12"]),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--graph", default="graphs/grpo.py")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads for the profile and the runs (default: torch's)"
    )
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="flowrl-fidelity-"))
    hw = profile(tmp / "cpu.yaml")
    rows = []
    for name, overrides in VARIANTS:
        common = [
            f"steps={args.steps}",
            "seed=0",
            "checkpoint=false",
            "progress=false",
            "rollout.ignore_eos=true",
            f"out={tmp / 'runs'}",
        ]
        if args.threads:
            common.append(f"threads={args.threads}")
        graph, plan = api.plan(args.graph, overrides=[*common, *overrides], emit=lambda s: None)
        result = api.run(graph, plan)
        measured = statistics.median(m["step_seconds"] for m in result.metrics[2:])
        # the same plan on the profiled device, with the copy task's real prompt length:
        # <s> + at most 4 letters and '>', left-padded to the longest
        cfg, w = plan.config, plan.workload
        workload = WorkloadSpec(
            prompts_per_step=w.prompts_per_step,
            samples_per_prompt=w.samples_per_prompt,
            prompt_length=6,
            response_length=Fixed(value=cfg.rollout.max_new_tokens),
            ppo_epochs=w.ppo_epochs,
            mini_batches=w.mini_batches,
        )
        target = ClusterTarget(
            cluster=ClusterSpec(nodes=1, devices_per_node=1, hardware=hw), model=plan.target.model, workload=workload
        )
        _, predicted = api.plan(
            args.graph, overrides=[*common, *overrides], target=target, for_backend=True, emit=lambda s: None
        )
        pred_s = predicted.layout.predicted.iteration_s
        error = pred_s / measured - 1
        row = {
            "variant": name,
            "measured_s": round(measured, 4),
            "predicted_s": round(pred_s, 4),
            "error": round(error, 3),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    errors = [abs(r["error"]) for r in rows]
    print(
        json.dumps(
            {
                "benchmark": "plan_fidelity",
                "variants": len(rows),
                "median_abs_error": round(statistics.median(errors), 3),
                "max_abs_error": round(max(errors), 3),
                "threads": args.threads,
                "hardware": {
                    "peak_gflops": round(hw.peak_flops_fp32 / 1e9, 1),
                    "matmul_efficiency": round(hw.matmul_efficiency, 3),
                    "kernel_overhead_us": round(hw.kernel_overhead * 1e6, 1),
                },
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
