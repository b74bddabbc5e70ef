"""Baseline: the GRPO benchmark job run with TRL's ``GRPOTrainer`` on CPU.

The job matches ``benchmarks/grpo_local.py`` (flowrl): a tiny 2-layer Llama with random
weights (``torch.manual_seed(0)``), flowrl's character tokenizer, the ``copy`` task,
P prompts x 8 samples per step, completions of exactly L tokens, temperature 1.0,
top_p 1.0, beta 0, one AdamW step (lr 1e-3, grad-norm clip 1.0) per generation batch.

Usage::

    python benchmarks/trl_grpo.py --prompts 8 --completion-len 64 --steps 20

Everything TRL / transformers print goes to stderr; stdout gets exactly one JSON line.

Torch's default thread count is left alone unless ``--threads N`` is given. On a small,
shared CPU box the default (one thread per core) can be far slower than 1 thread when
another process competes for the cores (OpenMP workers spin-wait), so compare runs only
with the same thread setting and load; ``torch_threads`` is reported in the JSON.

Choices made to match the job (also summarised in the JSON ``notes`` field):

- Ignoring EOS: ``generation_kwargs={"min_new_tokens": L}`` (GRPOConfig forwards it to
  ``transformers.GenerationConfig``), so the EOS logit is -inf for the first L tokens and
  every completion is exactly ``max_completion_length = L`` tokens long. The script checks
  the logged ``completions/min_length`` and ``max_length`` equal L.
- Loss: ``loss_type="dapo"`` (TRL's default): token-level losses summed and divided by the
  number of completion tokens in the global accumulated batch. With one generation batch
  per optimizer step and no gradient accumulation this is a plain token mean over the
  step's P*8*L completion tokens.
- Prompts: ``Copy().prompts(random.Random(0), steps * P)`` in order; ``shuffle_dataset=False``
  so step i uses prompts ``[i*P, (i+1)*P)``.
- Learning rate schedule constant (TRL/transformers default is linear decay), no warm-up,
  weight decay 0, gradient checkpointing off (TRL's default is on).
- Timing: a ``TrainerCallback`` stamps ``on_step_begin`` / ``on_step_end``; generation time
  is the wall time of ``model.generate`` (wrapped on the model instance) inside each step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import resource
import statistics
import sys
import time
import warnings

# Offline: nothing may reach a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

SAMPLES = 8
WARMUP_STEPS = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (P)")
    parser.add_argument("--completion-len", type=int, default=64, help="completion tokens per sample (L)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: leave torch's default untouched)",
    )
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    import datasets
    import transformers
    import trl
    from trl import GRPOConfig, GRPOTrainer

    from flowrl.tasks.builtin import Copy, Prompt
    from flowrl.tasks.tokenizer import build_tokenizer

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()

    P, L, steps = args.prompts, args.completion_len, args.steps
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    batch = P * SAMPLES

    tok = build_tokenizer()

    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    assert model.dtype == torch.float32 and model.config._attn_implementation == "eager"

    task = Copy()
    prompts = task.prompts(random.Random(0), steps * P)
    dataset = datasets.Dataset.from_dict({"prompt": [p.text for p in prompts], "answer": [p.answer for p in prompts]})

    def copy_reward(prompts, completions, answer, **kwargs):
        # ``completions`` are decoded with skip_special_tokens=True, cut after the first EOS
        # (none occur here because of min_new_tokens).
        return [task.score(Prompt(text=p, answer=a), c) for p, c, a in zip(prompts, completions, answer)]

    grpo_args = GRPOConfig(
        output_dir=os.path.join(os.environ.get("TMPDIR", "/tmp"), "trl_grpo_bench"),
        # Batch shape: one generation batch of P*8 completions = one optimizer step.
        num_generations=SAMPLES,
        per_device_train_batch_size=batch,
        generation_batch_size=batch,
        gradient_accumulation_steps=1,
        num_iterations=1,
        max_steps=steps,
        shuffle_dataset=False,
        # Generation.
        max_completion_length=L,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        generation_kwargs={"min_new_tokens": L},
        use_vllm=False,
        # Loss / optimizer.
        beta=0.0,
        loss_type="dapo",
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        optim="adamw_torch",
        max_grad_norm=1.0,
        gradient_checkpointing=False,
        # Device / precision.
        use_cpu=True,
        bf16=False,
        fp16=False,
        # Bookkeeping.
        logging_strategy="steps",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
    )

    step_begin: list[float] = []
    step_end: list[float] = []
    gen_times: list[float] = []  # one entry per model.generate call
    gen_calls_at_step_end: list[int] = []
    log_records: list[dict] = []

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            step_begin.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            step_end.append(time.perf_counter())
            gen_calls_at_step_end.append(len(gen_times))

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs is not None and "reward" in logs:
                log_records.append(dict(logs))

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=copy_reward,
        args=grpo_args,
        train_dataset=dataset,
        processing_class=tok,
        callbacks=[Timer()],
    )

    # Time generation: wrap generate on the (unwrapped) model instance TRL calls.
    gen_model = trainer.accelerator.unwrap_model(trainer.model)
    original_generate = gen_model.generate

    def timed_generate(*a, **kw):
        t0 = time.perf_counter()
        out = original_generate(*a, **kw)
        gen_times.append(time.perf_counter() - t0)
        return out

    gen_model.generate = timed_generate

    trainer.train()

    n = len(step_end)
    if n != steps or len(step_begin) != steps:
        raise RuntimeError(f"expected {steps} steps, timed {len(step_begin)} begins / {n} ends")
    if len(gen_times) != steps or gen_calls_at_step_end != list(range(1, steps + 1)):
        raise RuntimeError(f"expected one generate call per step, got {gen_calls_at_step_end}")
    if len(log_records) != steps:
        raise RuntimeError(f"expected {steps} logs with a reward, got {len(log_records)}")
    for entry in log_records:
        lo, hi = entry.get("completions/min_length"), entry.get("completions/max_length")
        if lo != L or hi != L:
            raise RuntimeError(f"completion lengths not exactly {L}: min {lo}, max {hi}")

    step_times = [e - b for b, e in zip(step_begin, step_end)]
    measured = list(range(WARMUP_STEPS, steps)) if steps > WARMUP_STEPS else list(range(steps))
    median_step = statistics.median(step_times[i] for i in measured)
    tokens_per_step = batch * L
    median_gen = statistics.median(gen_times[i] for i in measured)

    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    notes = (
        "EOS ignored via generation_kwargs min_new_tokens=L (checked: every logged completion length == L); "
        "gen_tokens_per_s = P*8*L / median over measured steps of model.generate wall time "
        "(generate wrapped on the model instance; excludes tokenization, reward, logprob/backward/optimizer); "
        f"median_step_s = median of on_step_begin->on_step_end over steps {WARMUP_STEPS + 1}..{steps} "
        "(step includes generation, reward, loss fwd/bwd, optimizer); "
        "loss_type=dapo (token mean over all completion tokens of the step, GA=1); "
        "lr_scheduler constant, AdamW (adamw_torch, wd 0), gradient_checkpointing off, "
        "prompts in order (shuffle_dataset=False), scale_rewards=group (TRL default), "
        f"torch threads {'set by --threads' if args.threads is not None else 'torch default'} "
        f"({torch.get_num_threads()}); "
        "first/last reward = TRL logged 'reward' of step 1 / last step"
    )

    return {
        "impl": "trl",
        "trl_version": trl.__version__,
        "prompts": P,
        "samples": SAMPLES,
        "completion_len": L,
        "steps": steps,
        "median_step_s": round(median_step, 4),
        "gen_tokens_per_s": round(tokens_per_step / median_gen, 1),
        "median_gen_s": round(median_gen, 4),
        "peak_rss_mib": round(peak_rss_mib, 1),
        "torch_threads": torch.get_num_threads(),
        "first_reward": log_records[0]["reward"],
        "last_reward": log_records[-1]["reward"],
        "notes": notes,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    warnings.simplefilter("ignore")
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    with contextlib.redirect_stdout(sys.stderr):
        result = run(args)
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
