"""Fit a serving engine's host work per decode step to published generation times.

The accelerator presets' ``decode_step_overhead`` (s per decode step: the scheduler, the sampler's
launch) and ``decode_row_overhead`` (s per live sequence per step: sampling, stop checks,
detokenisation) are the host-side work of a vLLM-class engine around its kernels, which the
roofline does not see. This script plans every case in benchmarks/published whose response
lengths and generation phase are published, with the published layout required and both
factors at 0, and fits them by the same least squares `flowrl calibrate` fits a run's trace with
(`flowrl.planner.calibrate.fit_factors`), generation phases only. It prints the fit and each
case's generation time before and after, and writes the result to
flowrl/planner/data/decode_overheads.yaml (with the cases it came from), which the presets read.

    python benchmarks/overheads_fit.py [--budget S] [--dry-run]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import tempfile
from pathlib import Path

import msgspec
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from published import HERE, _plan, graph_of, plan_argv, required_argv  # noqa: E402

from flowrl import api  # noqa: E402
from flowrl.contract.plan import load_plan
from flowrl.planner.calibrate import FACTORS, Replay, fit_factors, get, with_values  # noqa: E402
from flowrl.planner.traces import Measured  # noqa: E402
from flowrl.plugins.manager import registry  # noqa: E402

OUT = Path(__file__).parents[1] / "flowrl" / "planner" / "data" / "decode_overheads.yaml"
FITTED = ("decode_step_overhead", "decode_row_overhead")


def replay(path: Path, budget: float, tmp: Path, reg, families: list[str]) -> Replay | None:
    """The case planned with its layout required and the engine overheads at 0, measuring its generation."""
    case = yaml.safe_load(path.read_text())
    if case.get("family") not in families:
        return None
    w = case.get("workload") or {}
    seconds = ((case.get("published") or {}).get("phases") or {}).get("generation")
    if not w.get("mean_response_length") or not isinstance(seconds, (int, float)) or not w.get("prompts_per_step"):
        return None
    assumed: list[str] = []
    folder = tmp / path.stem
    folder.mkdir()
    if _plan(required_argv(case, [*plan_argv(case, folder, assumed), "--budget", str(budget)]))[0] != 0:
        return None
    plan = load_plan(folder / "plan.yaml")
    hw = with_values(plan.target.cluster.hardware, {f: 0.0 for f in FITTED})
    cluster = msgspec.structs.replace(plan.target.cluster, hardware=hw)
    plan = msgspec.structs.replace(plan, target=msgspec.structs.replace(plan.target, cluster=cluster))
    graph = api.graph_for_plan(plan, reg, source=graph_of(case))
    measured = Measured(
        run=case["name"],
        plan=plan,
        tasks={"rollout": float(seconds)},
        iteration_s=1.0,
        iterations=1,
        response_length={},
    )
    return Replay(measured=measured, graph=graph, workload=plan.target.workload, registry=reg, whole=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=2.0)
    ap.add_argument("--dry-run", action="store_true", help="print the fit, do not write the data file")
    ap.add_argument(
        "--family",
        action="append",
        default=None,
        help="fit the cases of these families (default: nemo-rl, whose vLLM decodes from CUDA graphs and whose "
        "generation timer holds generation alone; verl-ppo's ran vLLM eagerly with the old log-probs inside it)",
    )
    args = ap.parse_args()
    args.family = args.family or ["nemo-rl"]
    reg = registry()
    with tempfile.TemporaryDirectory() as tmp:
        replays = [r for p in sorted(HERE.glob("*.yaml")) if (r := replay(p, args.budget, Path(tmp), reg, args.family))]
    bases = [r.measured.plan.target.cluster.hardware for r in replays]
    factors = [f for f in FACTORS if f.path in FITTED]
    values, measured_by = fit_factors(replays, bases, factors, progress=print)
    rows = []
    for r, b in zip(replays, bases):
        before = r.predict(b).breakdown["rollout"]
        after = r.predict(with_values(b, values)).breakdown["rollout"]
        published = r.measured.tasks["rollout"]
        rows.append(
            {"case": r.measured.run, "published_s": published, "before_s": round(before, 2), "after_s": round(after, 2)}
        )
        print(f"{r.measured.run:<55} published {published:7.1f} s  before {before:7.1f} s  after {after:7.1f} s")
    for name in FITTED:
        print(f"{name}: {get(with_values(bases[0], values), name):.3g}")
    errors = [abs(math.log(row["after_s"] / row["published_s"])) for row in rows]
    if not args.dry_run:
        data = {
            "fitted": datetime.date.today().isoformat(),
            "by": "benchmarks/overheads_fit.py",
            "families": args.family,
            **{name: float(f"{values.get(name, 0.0):.4g}") for name in FITTED},
            "cases": rows,
        }
        OUT.write_text(
            "# A serving engine's host work per decode step, fitted to published generation phases\n"
            "# (benchmarks/published; sources in each case file). Written by benchmarks/overheads_fit.py.\n"
            + yaml.safe_dump(data, sort_keys=False)
        )
        print(f"written to {OUT}")
    print(
        json.dumps(
            {
                "bench": "overheads_fit",
                "cases": len(rows),
                **values,
                "mean_abs_log_error": round(sum(errors) / len(errors), 3),
                "measured_by": {k: len(v) for k, v in measured_by.items()},
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
