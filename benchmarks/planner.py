"""How long the auto-tuner takes to plan PPO (actor, critic, reference, reward model, one size)
for Llama 7B-70B on 16-128 A100-80G (1024 prompts per step, prompt and response 1024 tokens).

Prints one line per case, then one JSON line with every planning time (the done-when bar: < 10 s).

    python benchmarks/planner.py [--budget 8]
"""

from __future__ import annotations

import argparse
import json
import time

from flowrl import api
from flowrl.contract.plan import ClusterTarget
from flowrl.errors import PlanError
from flowrl.planner.hardware import parse_cluster
from flowrl.planner.modelspec import load_model_spec
from flowrl.planner.workload import WorkloadSpec

MODELS = ["llama-7b", "llama-13b", "llama-34b", "llama-70b"]
CLUSTERS = [16, 32, 64, 128]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=8.0)
    parser.add_argument("--graph", default="graphs/ppo_rm.py")
    args = parser.parse_args()
    cases = []
    for model in MODELS:
        for n in CLUSTERS:
            target = ClusterTarget(
                cluster=parse_cluster(f"{n}xA100-80G"), model=load_model_spec(model), workload=WorkloadSpec()
            )
            t0 = time.perf_counter()
            try:
                _, plan = api.plan(args.graph, target=target, options={"budget_s": args.budget}, emit=lambda s: None)
                pred = plan.layout.predicted
                case = {
                    "model": model,
                    "devices": n,
                    "plan_s": round(time.perf_counter() - t0, 3),
                    "iteration_s": round(pred.iteration_s, 2),
                    "efficiency": pred.efficiency,
                    "plan": plan.layout.summary(),
                }
            except PlanError as exc:
                case = {
                    "model": model,
                    "devices": n,
                    "plan_s": round(time.perf_counter() - t0, 3),
                    "error": str(exc)[:160],
                }
            cases.append(case)
            print(json.dumps(case), flush=True)
    times = [c["plan_s"] for c in cases]
    print(
        json.dumps(
            {
                "benchmark": "planner",
                "graph": args.graph,
                "max_plan_s": max(times),
                "median_plan_s": sorted(times)[len(times) // 2],
                "feasible": sum("error" not in c for c in cases),
                "cases": len(cases),
                "plan_s": {f"{c['model']}@{c['devices']}": c["plan_s"] for c in cases},
            }
        )
    )


if __name__ == "__main__":
    main()
