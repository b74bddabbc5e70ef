"""flowrl's local backend vs TRL's GRPOTrainer on the identical GRPO job, side by side.

For each (prompts per step P, completion length L) in {1, 8} x {16, 64} it runs
benchmarks/grpo_local.py and benchmarks/trl_grpo.py back to back (each in a fresh process,
so peak RSS is per job) and prints one JSON line per pair, then a final JSON line with the
ratios. Needs TRL: ``pip install trl``.

    python benchmarks/compare_trl.py --steps 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
COMBOS = [(1, 16), (1, 64), (8, 16), (8, 64)]


def run(script: str, prompts: int, length: int, steps: int) -> dict:
    cmd = [
        sys.executable,
        str(HERE / script),
        "--prompts",
        str(prompts),
        "--completion-len",
        str(length),
        "--steps",
        str(steps),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        sys.exit(f"{script} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    try:
        import trl  # noqa: F401
    except ImportError:
        sys.exit("compare_trl.py needs TRL: pip install trl")
    pairs = []
    for prompts, length in COMBOS:
        ours = run("grpo_local.py", prompts, length, args.steps)
        theirs = run("trl_grpo.py", prompts, length, args.steps)
        pair = {
            "prompts": prompts,
            "samples": 8,
            "completion_len": length,
            "flowrl_step_s": ours["median_step_s"],
            "trl_step_s": theirs["median_step_s"],
            "step_speedup": round(theirs["median_step_s"] / ours["median_step_s"], 2),
            "flowrl_gen_tok_s": ours["gen_tokens_per_s"],
            "trl_gen_tok_s": theirs["gen_tokens_per_s"],
            "flowrl_rss_mib": ours["peak_rss_mib"],
            "trl_rss_mib": theirs["peak_rss_mib"],
            "flowrl_reward": [ours["first_reward"], ours["last_reward"]],
            "trl_reward": [theirs["first_reward"], theirs["last_reward"]],
        }
        pairs.append(pair)
        print(json.dumps(pair), flush=True)
    speedups = [p["step_speedup"] for p in pairs]
    print(
        json.dumps(
            {
                "benchmark": "grpo_local_vs_trl",
                "steps": args.steps,
                "median_step_speedup_vs_trl": round(statistics.median(speedups), 2),
                "min_step_speedup_vs_trl": min(speedups),
                "gen_tok_s_ratio": [round(p["flowrl_gen_tok_s"] / p["trl_gen_tok_s"], 2) for p in pairs],
                "rss_ratio": [round(p["flowrl_rss_mib"] / p["trl_rss_mib"], 2) for p in pairs],
                "pairs": pairs,
            }
        )
    )


if __name__ == "__main__":
    main()
