"""How well the fitted efficiency curves (flowrl/planner/efficiency.py) reproduce the measured points of
flowrl/planner/data/efficiency.yaml.

Prints the fitted parameters per GPU family, one line per point (measured vs fitted efficiency and the
relative error), a summary per kind of work, then one JSON line over the whole-model points (train,
forward, prefill, decode: what the default curves are fitted to). GEMM points are the bare-matmul ceiling,
printed for reference and left out of the summary.

    python benchmarks/efficiency_fit.py [--data FILE] [--quiet]
"""

from __future__ import annotations

import argparse
import json
import statistics

from flowrl.planner.efficiency import DEFAULT_DATA, WHOLE_MODEL, default_curve, family, fitted, load_points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(DEFAULT_DATA), help="efficiency data file (default: the repo's)")
    parser.add_argument("--quiet", action="store_true", help="only the summary lines")
    args = parser.parse_args()

    points = load_points(args.data)
    for gpu in sorted({p.gpu for p in points}):
        curve = default_curve(gpu)
        print(
            f"{gpu:10s} family {family(gpu) or 'shared'}: e_max {curve.e_max:.3f}  k_w {curve.k_w:.3f}  "
            f"k_a {curve.k_a:.3f}  e_attn {curve.e_attn:.3f}  ridge {curve.ridge:.0f} FLOP/B  "
            f"tokens_half(h=4096) {curve.tokens_half(4096):.0f}"
        )
    rows = fitted(points)
    if not args.quiet:
        print(f"\n{'point':46s} {'kind':7s} {'tokens':>7s} {'hidden':>6s} {'seq':>6s} tp {'meas':>7s} {'fit':>7s}  err")
        for p, fit in rows:
            note = "  (ceiling, not fitted)" if p.kind not in WHOLE_MODEL else ""
            print(
                f"{p.id:46s} {p.kind:7s} {p.tokens:7.0f} {p.hidden:6d} {p.seq_len:6d} {p.tp:2d} "
                f"{p.efficiency:7.4f} {fit:7.4f} {fit / p.efficiency - 1:+5.0%}{note}"
            )
    errors = {p.id: abs(fit / p.efficiency - 1) for p, fit in rows if p.kind in WHOLE_MODEL}
    print()
    for kind in (*WHOLE_MODEL, "gemm"):
        errs = [abs(fit / p.efficiency - 1) for p, fit in rows if p.kind == kind]
        if errs:
            print(f"{kind:8s} {len(errs):4d} points  median |err| {statistics.median(errs):.1%}  max {max(errs):.1%}")
    worst = max(errors, key=errors.__getitem__)
    print(
        json.dumps(
            {
                "bench": "efficiency_fit",
                "points": len(errors),
                "median_rel_error": round(statistics.median(errors.values()), 4),
                "max_rel_error": round(errors[worst], 4),
                "worst_point": worst,
            }
        )
    )


if __name__ == "__main__":
    main()
