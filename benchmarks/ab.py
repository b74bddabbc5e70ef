"""Run one benchmark script from two git revisions side by side, alternating; print one JSON line.

The base revision is checked out into a temporary git worktree and run with the same Python
(its ``flowrl`` package shadows the installed one through PYTHONPATH); the other side is the
working tree. Runs alternate (base, new, base, new, ...) so machine noise hits both alike.
Each run must print a JSON line last; ``--key`` names the field compared (lower is better).

    python benchmarks/ab.py --base HEAD~1 --runs 3 -- benchmarks/grpo_local.py --steps 12
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_once(tree: Path, script: str, args: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "FLOWRL_PLUGINS": ""}
    out = subprocess.run(
        [sys.executable, str(tree / script), *args], cwd=tree, env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD~1", help="git revision to compare against")
    parser.add_argument("--runs", type=int, default=3, help="runs per side")
    parser.add_argument("--key", default="median_step_s", help="the JSON field compared (lower is better)")
    parser.add_argument("script", help="benchmark script, relative to the repository root")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    opts = parser.parse_args()
    args = [a for a in opts.args if a != "--"]
    with tempfile.TemporaryDirectory(prefix="flowrl-ab-") as tmp:
        base = Path(tmp) / "base"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(base), opts.base], cwd=ROOT, check=True, capture_output=True
        )
        try:
            (base / "flowrl" / "graphs").symlink_to(
                base / "graphs"
            )  # the installed layout maps graphs/ to flowrl.graphs
            sides: dict[str, list[dict]] = {"base": [], "new": []}
            for _ in range(opts.runs):
                sides["base"].append(run_once(base, opts.script, args))
                sides["new"].append(run_once(ROOT, opts.script, args))
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, check=False, capture_output=True
            )
    medians = {side: statistics.median(r[opts.key] for r in runs) for side, runs in sides.items()}
    record = {
        "benchmark": "ab",
        "script": opts.script,
        "base": opts.base,
        "key": opts.key,
        "runs": opts.runs,
        "base_median": medians["base"],
        "new_median": medians["new"],
        "new_over_base": round(medians["new"] / medians["base"], 3),
        "base_runs": [r[opts.key] for r in sides["base"]],
        "new_runs": [r[opts.key] for r in sides["new"]],
    }
    print(json.dumps(record))


if __name__ == "__main__":
    main()
