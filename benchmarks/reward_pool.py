"""Reward execution side by side: a GRPO step whose reward waits 50 ms per response, scored in the
driver (one call per batch), by pools of 1, 2, 4 and 8 worker processes (a call per response), and
by the widest pool with streaming rollouts (scoring finished groups while generation goes on).

Each configuration runs the same graph (`benchmarks/graphs/slow_reward.py`), seed and sizes on the
local backend; the median step time over the steps after the first is compared with the driver's.
The reward sleeps (a remote verifier's latency), so a pool's gain is its width whatever the cores.
The last line is JSON.

    python benchmarks/reward_pool.py [--steps 6] [--prompts 8] [--samples 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIGS = [  # (name, --set overrides)
    ("driver", []),
    ("pool 1", ["reward.workers=1"]),
    ("pool 2", ["reward.workers=2"]),
    ("pool 4", ["reward.workers=4"]),
    ("pool 8", ["reward.workers=8"]),
    ("pool 8 streaming", ["reward.workers=8", "rollout.mode=streaming", "rollout.stream_groups=2"]),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    args = parser.parse_args()
    from flowrl import api

    rows = {}
    out = Path(tempfile.mkdtemp(prefix="flowrl-reward-pool-"))
    for name, extra in CONFIGS:
        overrides = [
            f"steps={args.steps}",
            f"rollout.prompts_per_step={args.prompts}",
            f"rollout.samples_per_prompt={args.samples}",
            "progress=false",
            "checkpoint=false",
            f"out={out}",
            f"name={name.replace(' ', '-')}",
            *extra,
        ]
        graph, plan = api.plan(str(HERE / "graphs" / "slow_reward.py"), overrides=overrides, emit=lambda s: None)
        result = api.run(graph, plan)
        steps = result.metrics[1:] or result.metrics
        rows[name] = {
            "step_s": round(statistics.median(m["step_seconds"] for m in steps), 4),
            "reward_s": round(statistics.median(m["spans"]["reward"] for m in steps), 4),
            "errors": sum(m.get("reward/errors", 0) for m in result.metrics),
        }
        print(f"{name:<18} step {rows[name]['step_s']:.3f} s   reward node {rows[name]['reward_s']:.3f} s", flush=True)
    base = rows["driver"]["step_s"]
    print(
        json.dumps(
            {
                "benchmark": "reward_pool",
                "reward_ms_per_response": 50,
                "responses_per_step": args.prompts * args.samples,
                "step_speedup_vs_driver": {k: round(base / v["step_s"], 2) for k, v in rows.items()},
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
