"""The local backend on a GPU: generation vs training log-probs, and a short GRPO run. One JSON line.

python benchmarks/device_check.py --steps 300
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from flowrl import api
from flowrl.contract.data import Prompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="/tmp/flowrl-device")
    args = parser.parse_args()
    common = [f"device={args.device}", "progress=false", "checkpoint=false", f"out={args.out}"]
    graph, plan = api.plan("grpo", overrides=[*common, "steps=0"], emit=lambda s: None)
    ex = api.check(graph, plan)
    actor = ex.engines(graph, plan)[0]["actor"]
    prompts = [Prompt(text=t, answer=t[:-1]) for t in ("abcd>", "b>", "dca>")]
    rollout = actor.generate(prompts, n=16, greedy=False, generator=torch.Generator().manual_seed(0))
    seqs, gen_lp = rollout.sequences, rollout.logprobs
    fwd = actor.forward(seqs, "logprobs", 0)
    diff = float((gen_lp - fwd)[seqs.response_mask.bool()].abs().max())
    graph, plan = api.plan("grpo", overrides=[*common, f"steps={args.steps}"], emit=lambda s: None)
    result = api.run(graph, plan)
    rewards = [m["reward"] for m in result.metrics]
    k = max(1, min(10, len(rewards) // 5))
    print(
        json.dumps(
            {
                "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
                "torch": torch.__version__,
                "plan_memory_capacity_gib": round(plan.memory[0].capacity_bytes / 1024**3, 1),
                "max_logprob_diff_gen_vs_train": diff,
                "steps": args.steps,
                "reward_first": round(sum(rewards[:k]) / k, 3),
                "reward_last": round(sum(rewards[-k:]) / k, 3),
                "median_step_s": round(statistics.median(m["step_seconds"] for m in result.metrics), 4),
                "median_gen_tokens_per_s": round(statistics.median(m["tokens_per_s"] for m in result.metrics), 1),
            }
        )
    )


if __name__ == "__main__":
    main()
