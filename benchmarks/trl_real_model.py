"""TRL's GRPOTrainer on benchmarks/real_model.py's job (run by it with ``--trl PYTHON``).

The same model folder, train file (GSM8K format), system prompt and chat template (TRL applies
the tokenizer's template to conversational prompts), P prompts x N samples, at most L new tokens,
learning rate, beta (KL), one AdamW step per generation batch, constant schedule, and a reward
by flowrl's ``math`` verifier on the final answer. It saves the trained model and prints one JSON
line: ``{"model_dir": ..., "s_per_step": ..., "reward_first5": ..., "reward_last5": ...}``;
real_model.py evaluates that folder with flowrl's evaluation (the same validation set and metrics).

Needs a Python with trl (see benchmarks/trl_grpo.py for its venv) and flowrl installed (for the
verifier): ``pip install -e /path/to/flowrl`` in that venv.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--train", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--beta", type=float, default=0.0)
    p.add_argument("--system", default="")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bf16", action="store_true", help="bfloat16 autocast (TRL's bf16=True)")
    p.add_argument("--attention", default="sdpa", help="attn_implementation the model loads with (sdpa, eager)")
    args = p.parse_args()

    import datasets
    import torch
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    from flowrl.tasks.verifiers import ground_truth, verify

    rows = [json.loads(line) for line in Path(args.train).read_text().splitlines() if line.strip()]
    dataset = datasets.Dataset.from_list(
        [
            {
                "prompt": [{"role": "system", "content": args.system}, {"role": "user", "content": r["question"]}],
                "truth": ground_truth(r["answer"]),
            }
            for r in rows
        ]
    )

    def math_reward(completions, truth, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [verify("math", t, a) for t, a in zip(texts, truth)]

    tok = transformers.AutoTokenizer.from_pretrained(args.model)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.float32, attn_implementation=args.attention
    )
    batch = args.prompts * args.samples
    config = GRPOConfig(
        output_dir=str(Path(args.out) / "trainer"),
        num_generations=args.samples,
        per_device_train_batch_size=batch,
        steps_per_generation=1,
        gradient_accumulation_steps=1,
        num_iterations=1,
        max_steps=args.steps,
        max_completion_length=args.tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        use_vllm=False,
        beta=args.beta,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        use_cpu=True,
        bf16=args.bf16,
        gradient_checkpointing=False,  # TRL's default recomputes layers: slower, and memory is no issue here
        logging_strategy="steps",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=args.seed,
    )
    rewards: list[float] = []
    ends: list[float] = []

    class Log(transformers.TrainerCallback):
        def on_step_end(self, args_, state, control, **kwargs):
            ends.append(time.perf_counter())

        def on_log(self, args_, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=math_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tok,
        callbacks=[Log()],
    )
    started = time.perf_counter()
    trainer.train()
    out = Path(args.out) / "model"
    trainer.model.save_pretrained(out)
    tok.save_pretrained(out)
    steps = [b - a for a, b in zip([started, *ends[:-1]], ends)]
    print(
        json.dumps(
            {
                "model_dir": str(out.resolve()),
                "s_per_step": round(sorted(steps)[len(steps) // 2], 2) if steps else None,
                "reward_first5": round(sum(rewards[:5]) / max(1, len(rewards[:5])), 4),
                "reward_last5": round(sum(rewards[-5:]) / max(1, len(rewards[-5:])), 4),
            }
        )
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
