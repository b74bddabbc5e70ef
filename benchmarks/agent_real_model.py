"""A user's agent, unaware of flowrl, trains a real model through the OpenAI-compatible endpoint.

SmolLM2-135M-Instruct (benchmarks/real_model.py makes its HF folder from the registry's GGUF wheel)
is post-trained with GRPO where every episode is one run of ``examples/agents/word_problem_agent.py``:
the plain ``openai`` client asks a GSM8K-format arithmetic word problem, gives a second try when the
final number is wrong, and returns the reward. Validation is flowrl's evaluation of the policy itself
(greedy accuracy and mean@K on held-out problems, one turn) before training and after the last step.
The final JSON line has both, the agent's reward over the first and last steps, requests per
episode, seconds per step, and the endpoint's refusals.

    python benchmarks/agent_real_model.py --steps 20        # ~20 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from real_model import CACHE, SYSTEM, model_folder, write_data  # noqa: E402

GRAPH = """
from flowrl.graph import Graph


def build(cfg):
    g = Graph("agent_word_problems")
    g.model("actor", "actor")
    g.generate(
        "episodes", model="actor", reads="prompts", writes="responses", n=cfg.rollout.samples_per_prompt,
        agent="{agent}", turns=2, turn_tokens={tokens}, timeout=300, max_tokens={tokens},
    )
    g.forward("old_logprobs", model="actor", output="logprobs", reads="responses", writes="old_logprobs")
    g.reward("reward", fn="agent", reads="prompts responses", writes="rewards")
    g.compute("advantages", fn="grpo", reads="rewards responses", writes="advantages")
    g.train("train_actor", model="actor", loss="ppo", reads="responses old_logprobs advantages")
    return g
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--samples", type=int, default=4, help="episodes per prompt")
    p.add_argument("--tokens", type=int, default=48, help="new tokens per model turn")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--train", type=int, default=1000)
    p.add_argument("--val", type=int, default=64)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", type=Path, default=CACHE)
    p.add_argument("--out", type=Path, default=Path("runs/agent_real_model"))
    args = p.parse_args()

    model = model_folder(args.cache)
    train, val = write_data(args.out / "data", args.train, args.val)
    graph = args.out / "agent_graph.py"
    agent = ROOT / "examples" / "agents" / "word_problem_agent.py"
    graph.write_text(GRAPH.format(agent=f"{agent}:run", tokens=args.tokens))
    budget = 2 * args.tokens + 40  # two turns and the agent's message between them
    cmd = [
        sys.executable, "-m", "flowrl", "run", str(graph), "--model", str(model), "--data", str(train),
        "--steps", str(args.steps), "--seed", str(args.seed), "--out", str(args.out), "--name", "agent",
        "--set", f"data.val={val}", "--set", "data.prompt_key=question", "--set", "data.answer_key=answer",
        "--set", "data.verifier=math", "--set", f"data.system_prompt={SYSTEM}",
        "--set", f"eval.every={args.steps}", "--set", f"eval.samples={args.k}", "--set", f"eval.max_prompts={args.val}",
        "--set", f"rollout.prompts_per_step={args.prompts}", "--set", f"rollout.samples_per_prompt={args.samples}",
        "--set", f"rollout.max_new_tokens={budget}", "--set", f"train.lr={args.lr}", "--set", "train.mini_batches=1",
        "--set", "checkpoint=false", "--quiet",
    ]  # fmt: skip
    started = time.perf_counter()
    proc = subprocess.run(cmd, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        sys.exit(f"flowrl run failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}")
    records = [json.loads(line) for line in (args.out / "agent" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("kind") is None and "step" in r]
    evals = [r for r in records if r.get("kind") == "eval"]
    first, last = steps[: max(len(steps) // 4, 1)], steps[-max(len(steps) // 4, 1) :]
    mean = lambda rows, key: round(statistics.mean(r[key] for r in rows), 4)  # noqa: E731
    episodes = sum(r["episodes/episodes"] for r in steps)
    result = {
        "model": "SmolLM2-135M-Instruct",
        "agent": "examples/agents/word_problem_agent.py (plain openai client, 2 tries)",
        "steps": len(steps),
        "prompts": args.prompts,
        "samples": args.samples,
        "greedy_before": evals[0]["eval/greedy"],
        "greedy_after": evals[-1]["eval/greedy"],
        f"mean@{args.k}_before": evals[0][f"eval/mean@{args.k}"],
        f"mean@{args.k}_after": evals[-1][f"eval/mean@{args.k}"],
        "agent_reward_first_quarter": mean(first, "reward"),
        "agent_reward_last_quarter": mean(last, "reward"),
        "requests_per_episode": round(sum(r["episodes/requests"] for r in steps) / max(episodes, 1), 3),
        "agent_errors": sum(r["episodes/agent_errors"] for r in steps),
        "timeouts": sum(r["episodes/timeouts"] for r in steps),
        "refused": sum(r["episodes/refused"] for r in steps),
        "forks": sum(r["episodes/forks"] for r in steps),
        "s_per_step": round(statistics.median(r["step_seconds"] for r in steps), 2),
        "wall_s": round(wall, 1),
    }
    result["greedy_gain"] = round(result["greedy_after"] - result["greedy_before"], 4)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
