"""Code RL's sandbox, before and after: what judging one response costs, and how graphs/code_rl.py learns.

Both parts use only interfaces an older checkout has too (`flowrl.tasks.sandbox.run_tests`, `flowrl.api`),
so the same command compares two checkouts: run it here, then with ``PYTHONPATH=OLD_CHECKOUT`` from that
checkout's folder.

    python benchmarks/code_rl_sandbox.py [--responses 40] [--steps 60]

``ms_per_response``: wall milliseconds to judge one response to the expr task's four add-3 asserts.
``reward_first10`` / ``reward_last10``: graphs/code_rl.py's mean reward over its first and last ten steps
(seed 0, one layer, 8 prompts a step), ``all_passed_last10`` the fraction passing every test, ``wall_s``
the run. The final line is JSON.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from statistics import mean

from flowrl import api
from flowrl.tasks.sandbox import Limits, run_tests

TESTS = ["assert f(0) == 3", "assert f(1) - f(0) == 1", "assert f(2) == 3 + 2", "assert f(5) == 3 + 5"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--responses", type=int, default=40, help="responses judged for ms_per_response")
    parser.add_argument("--steps", type=int, default=60, help="code_rl steps (0: skip the learning run)")
    args = parser.parse_args()
    run_tests("f = lambda x: x", TESTS, Limits(wall_s=5, cpu_s=2))  # warm: the first run decides the sandbox
    t0 = time.perf_counter()
    for i in range(args.responses):
        run_tests(f"f = lambda x: x + {i % 5}", TESTS, Limits(wall_s=5, cpu_s=2))
    out: dict[str, float | int] = {"ms_per_response": round((time.perf_counter() - t0) / args.responses * 1000, 1)}
    if args.steps:
        overrides = [f"steps={args.steps}", "seed=0", "progress=false", f"out={tempfile.mkdtemp()}"]
        overrides += ["checkpoint=false", "tiny_model.num_layers=1", "rollout.prompts_per_step=8"]
        t0 = time.perf_counter()
        graph, plan = api.plan("graphs/code_rl.py", overrides=overrides, emit=lambda s: None)
        metrics = api.run(graph, plan).metrics
        rewards = [m["reward"] for m in metrics]
        out.update(
            steps=args.steps,
            reward_first10=round(mean(rewards[:10]), 3),
            reward_last10=round(mean(rewards[-10:]), 3),
            all_passed_last10=round(mean(m.get("reward/all_passed", 0.0) for m in metrics[-10:]), 3),
            wall_s=round(time.perf_counter() - t0, 1),
        )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
