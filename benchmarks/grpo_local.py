"""Time a fixed GRPO job on the local backend; print one JSON line.

The job is the same as benchmarks/trl_grpo.py runs with TRL's GRPOTrainer:
- a tiny Llama (hidden 128, intermediate 256, 2 layers, 4 heads, 2 KV heads, vocab 512),
  random init (seed 0), fp32, and flowrl's character tokenizer;
- the 'copy' task, P prompts x 8 samples per step, exactly L completion tokens (EOS ignored),
  temperature 1, no reference model (beta = 0), one AdamW step per batch (lr 1e-3, clip 1.0),
  token-mean PPO loss.

This file is also the graph it runs (``build`` below): GRPO where the generation log-probs
serve as the old log-probs (as TRL does with one iteration per batch).

    python benchmarks/grpo_local.py --prompts 8 --completion-len 64 --steps 20
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
from pathlib import Path

from flowrl.graph import Graph


def build(cfg):
    g = Graph("grpo_bench")
    g.model("actor", "actor")
    g.generate(
        "rollout", model="actor", reads="prompts", writes="responses old_logprobs", n=cfg.rollout.samples_per_prompt
    )
    g.reward("reward", fn="task", reads="prompts responses", writes="rewards")
    g.compute("advantages", fn="grpo", reads="rewards responses", writes="advantages")
    g.train("train_actor", model="actor", loss="ppo", reads="responses old_logprobs advantages")
    return g


def job_overrides(prompts: int, completion_len: int, steps: int) -> list[str]:
    return [
        "task=copy",
        f"steps={steps}",
        "seed=0",
        "checkpoint=false",
        "progress=false",
        "tiny_model.hidden_size=128",
        "tiny_model.intermediate_size=256",
        "tiny_model.num_layers=2",
        "tiny_model.num_heads=4",
        "tiny_model.num_kv_heads=2",
        "tiny_model.vocab_size=512",
        f"rollout.prompts_per_step={prompts}",
        "rollout.samples_per_prompt=8",
        f"rollout.max_new_tokens={completion_len}",
        "rollout.ignore_eos=true",
        "rollout.temperature=1.0",
        "train.lr=1e-3",
        "train.mini_batches=1",  # one AdamW step per batch, as TRL takes
        "train.grad_clip=1.0",
        "algo.kl_coef=0.0",
        "algo.clip_high=0.2",
    ]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--completion-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the medians")
    parser.add_argument("--out", default="/tmp/flowrl-bench")
    args = parser.parse_args(argv)

    from flowrl import api
    from flowrl.runtime.executor import run_dir

    overrides = [*job_overrides(args.prompts, args.completion_len, args.steps), f"out={args.out}"]
    graph, plan = api.plan(str(Path(__file__).resolve()), overrides=overrides, emit=lambda s: None)
    result = api.run(graph, plan, out_dir=run_dir(args.out, "grpo_bench"))
    timed = result.metrics[args.warmup :] or result.metrics
    gen_seconds = [m["spans"]["rollout"] for m in timed]
    tokens = [m["tokens"] for m in timed]
    record = {
        "impl": "flowrl",
        "prompts": args.prompts,
        "samples": 8,
        "completion_len": args.completion_len,
        "steps": args.steps,
        "median_step_s": round(statistics.median(m["step_seconds"] for m in timed), 4),
        "gen_tokens_per_s": round(sum(tokens) / sum(gen_seconds), 1),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "first_reward": result.metrics[0]["reward"],
        "last_reward": result.metrics[-1]["reward"],
    }
    print(json.dumps(record))
    sys.stdout.flush()
    return record


if __name__ == "__main__":
    main()
