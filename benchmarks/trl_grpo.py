"""Baseline: the GRPO benchmark job run with TRL's ``GRPOTrainer`` on CPU.

Two uses:

1. Throughput peer of ``benchmarks/grpo_local.py`` (the default; ``benchmarks/compare_trl.py``
   calls it with ``--prompts/--completion-len/--steps`` only). The job matches
   ``grpo_local.py`` (flowrl): a tiny 2-layer Llama with random weights
   (``torch.manual_seed(0)``, hidden 128, intermediate 256, vocab 512), flowrl's character
   tokenizer, the ``copy`` task, P prompts x 8 samples per step, completions of exactly L
   tokens, temperature 1.0, top_p 1.0, beta 0, one AdamW step (lr 1e-3, grad-norm clip 1.0)
   per generation batch.
2. Learning peer of a flowrl GRPO run (``graphs/grpo.py``) on any built-in task, e.g. the
   long-tailed ``repeat`` task: completions stop at EOS (``--eos``), flowrl's tiny model and
   AdamW betas, and the flags below set to flowrl's defaults. It reports the per-step mean
   task reward, the final reward and the wall-clock time to a target reward.

Usage::

    python benchmarks/trl_grpo.py --prompts 8 --completion-len 64 --steps 20
    # learning comparison on 'repeat' with flowrl's GRPO defaults (flowrl: task=repeat):
    python benchmarks/trl_grpo.py --task repeat --prompts 32 --samples 16 --eos --lr 2e-3 \\
        --beta 0.05 --epsilon 0.2 --epsilon-high 0.28 --mini-batches 2 --steps 300

Setup: TRL goes in its own venv, so that it cannot change the project venv's transformers
(these are the versions the script was checked with; trl 1.16.0 accepts transformers 5.24.0
and installs no other torch or transformers)::

    python3 -m venv /work/trl-venv
    /work/trl-venv/bin/pip install torch==2.13.0            # the CPU wheel
    /work/trl-venv/bin/pip install transformers==5.24.0     # = the project venv's version
    /work/trl-venv/bin/pip install trl==1.16.0              # + accelerate 1.15.0, datasets 5.2.0
    /work/trl-venv/bin/pip install -e /work/main            # flowrl itself: tokenizer and tasks
    /work/trl-venv/bin/python benchmarks/trl_grpo.py ...

Everything TRL / transformers print goes to stderr; stdout gets exactly one JSON line.

Torch's default thread count is left alone unless ``--threads N`` is given. On a small,
shared CPU box the default (one thread per core) can be far slower than 1 thread when
another process competes for the cores (OpenMP workers spin-wait), so compare runs only
with the same thread setting and load; ``torch_threads`` is reported in the JSON.

Options and the flowrl settings they stand for (flowrl's defaults in brackets):

- ``--task NAME`` / ``--task-option key=value`` (repeatable): ``task=NAME`` / the task's
  options (built with ``flowrl.tasks.builtin.make_task``; values that look numeric become
  int/float), e.g. ``--task repeat --task-option median=3 --task-option sigma=0.75``.
- ``--prompts P``: ``rollout.prompts_per_step`` [32]. ``--samples N``:
  ``rollout.samples_per_prompt`` [16] (TRL ``num_generations``; default 8 here).
- ``--eos``: ``rollout.ignore_eos=false`` [false]. Completions stop at the first EOS, up to
  ``--completion-len`` tokens, which then defaults to the task's ``max_new_tokens()``
  (flowrl's ``rollout.max_new_tokens=None``). Without ``--eos`` every completion is exactly
  L tokens (``rollout.ignore_eos=true``, as in ``grpo_local.py``).
- ``--lr``: ``train.lr`` [2e-3] (default 1e-3 here). Always: constant schedule, no warm-up,
  weight decay 0 (``train.weight_decay`` [0]), grad-norm clip 1.0 (``train.grad_clip`` [1.0]).
- ``--beta``: ``algo.kl_coef`` [0.05] with ``algo.kl_estimator`` [k3]: TRL adds
  beta * k3(pi || ref) per token, ref = the initial model (flowrl's ``ref`` model,
  ``init_from="actor"``). Default 0 here: no reference model.
- ``--epsilon`` / ``--epsilon-high``: ``algo.clip_low`` [0.2] / ``algo.clip_high`` [0.28]
  (default TRL's: 0.2 / equal to epsilon).
- ``--mini-batches M``: ``train.mini_batches`` [2] (default 1 here). Each generation batch of
  P*N samples is shuffled and split into M mini-batches of P*N/M samples, one optimizer step
  each: TRL ``steps_per_generation=M``, ``per_device_train_batch_size=P*N/M``,
  ``gradient_accumulation_steps=1``, ``max_steps=steps*M``. With M > 1 TRL computes the old
  log-probs with a forward pass of the generating weights (flowrl's ``old_logprobs`` node).
  One pass over each batch: ``num_iterations=1`` = ``train.epochs`` [1].
- Loss: token mean over the mini-batch's completion tokens (flowrl: "exact token-mean over the
  mini-batch"): ``loss_type="dapo"`` (TRL's default) when M = 1, where it is the token mean
  over the step's P*N completions; ``loss_type="bnpo"`` when M > 1 (``dapo`` would divide each
  mini-batch's token sum by the whole batch's token count / M rather than its own count).
- ``--model {bench,tiny}``: ``bench`` is ``grpo_local.py``'s model (hidden 128, intermediate 256,
  vocab 512); ``tiny`` is flowrl's ``TinyModelConfig`` defaults [hidden 64, intermediate 128,
  2 layers, 4 heads, 2 KV heads, max_position_embeddings 128, vocab = the tokenizer's size].
  Both: untied embeddings, eager attention, fp32, ``torch.manual_seed(seed)`` before init.
  ``--adam-beta2``: AdamW betas (0.9, beta2); flowrl's ``train.betas`` [(0.9, 0.99)], TRL's
  default (0.9, 0.999). Unless given, both follow the job: the throughput job (``--task copy``
  without ``--eos``) keeps ``bench`` / 0.999; any other run gets flowrl's ``tiny`` / 0.99.
- Fixed: temperature 1.0, top_p 1.0, top_k 0 (``rollout.temperature`` [1.0],
  ``rollout.top_p`` [1.0]); GRPO advantages (r - mean_group) / (std_group + eps), unbiased
  std (TRL ``scale_rewards="group"``, eps 1e-4; flowrl's ``grpo`` uses eps 1e-6).
- ``--seed``: ``seed`` [0]: model init, the prompt rng and TRL's seed.
- ``--target-reward R`` (default 0.8): the target of ``seconds_to_target``.

Choices made to match the job (also summarised in the JSON ``notes`` field):

- Ignoring EOS (without ``--eos``): ``generation_kwargs={"min_new_tokens": L}`` (GRPOConfig
  forwards it to ``transformers.GenerationConfig``), so the EOS logit is -inf for the first L
  tokens and every completion is exactly ``max_completion_length = L`` tokens long. The script
  checks the logged ``completions/min_length`` and ``max_length`` equal L (with ``--eos``:
  max_length <= L).
- Prompts: ``task.prompts(random.Random(seed), steps * P)`` in order; ``shuffle_dataset=False``
  so step i uses prompts ``[i*P, (i+1)*P)``. TRL tokenizes them with the tokenizer's special
  tokens (BOS), as flowrl does.
- Rewards: the only reward function is the task's ``score`` (1.0 for the exact answer, partial
  credit otherwise) of the completion TRL decodes (special tokens skipped, cut after the first
  EOS), so the ``reward`` TRL logs per step is the mean task score over the step's P*N samples.
- Gradient checkpointing off (TRL's default is on); completions cut at the length limit are
  trained on (``mask_truncated_completions=False``, TRL's default, as flowrl).
- Timing: a ``TrainerCallback`` stamps ``on_step_begin`` / ``on_step_end``. A TRL step is one
  optimizer step; a step here is one generation batch (M optimizer steps), timed from the
  begin of its first to the end of its last. Generation time is the wall time of
  ``model.generate`` (wrapped on the model instance) inside each step.

JSON fields for the learning comparison (besides the throughput ones): ``task``,
``samples_per_s`` (P*N / the median step seconds over the steps after the first 2),
``rewards`` (TRL's logged mean reward of every step, 4 digits), ``final_reward`` (mean of
``rewards`` over the last 10% of steps, at least 1), ``seconds_to_target`` (wall clock from the
first step's begin to the end of the first step whose trailing mean reward over the last 5
steps, fewer for the first 4, reaches ``--target-reward``; null if never) and
``mean_completion_length`` (completion tokens including the EOS token, mean over all samples).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import re
import resource
import statistics
import sys
import tempfile
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
SMOOTH_STEPS = 5  # trailing window of seconds_to_target

_INT = re.compile(r"[+-]?\d+")
_FLOAT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def option_value(text: str) -> int | float | str:
    """``"3"`` -> 3, ``"0.75"`` / ``"1e-3"`` -> float, anything else stays a string."""
    if _INT.fullmatch(text):
        return int(text)
    if _FLOAT.fullmatch(text):
        return float(text)
    return text


def task_options(pairs: list[str]) -> dict[str, int | float | str]:
    options: dict[str, int | float | str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"--task-option wants key=value, got {pair!r}")
        options[key.strip()] = option_value(value.strip())
    return options


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (P)")
    parser.add_argument(
        "--completion-len",
        type=int,
        default=None,
        help="completion tokens per sample (L); with --eos the most per sample "
        "(default 64, with --eos the task's max_new_tokens())",
    )
    parser.add_argument("--steps", type=int, default=20, help="generation steps (each M optimizer steps)")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: leave torch's default untouched)",
    )
    parser.add_argument("--task", default="copy", help="built-in flowrl task (default copy)")
    parser.add_argument(
        "--task-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="task option (repeatable); numeric-looking values become int/float",
    )
    parser.add_argument("--samples", type=int, default=SAMPLES, help=f"samples per prompt (N, default {SAMPLES})")
    parser.add_argument("--eos", action="store_true", help="stop each completion at EOS (variable length up to L)")
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    parser.add_argument("--beta", type=float, default=0.0, help="KL coefficient, k3 estimator (default 0)")
    parser.add_argument("--epsilon", type=float, default=None, help="PPO clip low (default TRL's, 0.2)")
    parser.add_argument("--epsilon-high", type=float, default=None, help="PPO clip high (default: = epsilon)")
    parser.add_argument(
        "--mini-batches", type=int, default=1, help="optimizer steps per generation batch (M, default 1)"
    )
    parser.add_argument("--target-reward", type=float, default=0.8, help="target of seconds_to_target (0.8)")
    parser.add_argument("--seed", type=int, default=0, help="model init, prompts and TRL seed (default 0)")
    parser.add_argument(
        "--model",
        choices=("bench", "tiny"),
        default=None,
        help="bench: grpo_local.py's model; tiny: flowrl's TinyModelConfig "
        "(default: bench for --task copy without --eos, else tiny)",
    )
    parser.add_argument(
        "--adam-beta2",
        type=float,
        default=None,
        help="AdamW beta2 (default: 0.999 for --task copy without --eos, else flowrl's 0.99)",
    )
    args = parser.parse_args(argv)
    checks = [
        (args.prompts >= 1, "--prompts must be >= 1"),
        (args.steps >= 1, "--steps must be >= 1"),
        (args.samples >= 2, "--samples must be >= 2 (GRPO compares samples of a prompt)"),
        (args.mini_batches >= 1, "--mini-batches must be >= 1"),
        (args.completion_len is None or args.completion_len >= 1, "--completion-len must be >= 1"),
        (
            (args.prompts * args.samples) % args.mini_batches == 0,
            f"--mini-batches {args.mini_batches} must divide prompts x samples = {args.prompts * args.samples}",
        ),
    ]
    for ok, why in checks:
        if not ok:
            parser.error(why)
    return args


def trailing_means(values: list[float], window: int) -> list[float]:
    """Mean of ``values[max(0, i - window + 1) : i + 1]`` for every i."""
    return [statistics.fmean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def run(args: argparse.Namespace) -> dict:
    import datasets
    import transformers
    import trl
    from trl import GRPOConfig, GRPOTrainer

    from flowrl.contract.data import Prompt
    from flowrl.errors import TaskError
    from flowrl.specs import TinyModelConfig
    from flowrl.tasks.builtin import make_task
    from flowrl.tasks.tokenizer import build_tokenizer

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()

    options = task_options(args.task_option)
    try:
        task = make_task(args.task, options)
    except TaskError as e:
        raise SystemExit(str(e)) from None
    P, N, M, steps = args.prompts, args.samples, args.mini_batches, args.steps
    L = args.completion_len if args.completion_len is not None else (task.max_new_tokens() if args.eos else 64)
    throughput_job = args.task == "copy" and not args.eos
    model_kind = args.model or ("bench" if throughput_job else "tiny")
    beta2 = args.adam_beta2 if args.adam_beta2 is not None else (0.999 if throughput_job else 0.99)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    batch = P * N
    loss_type = "dapo" if M == 1 else "bnpo"

    tok = build_tokenizer()

    if model_kind == "bench":
        dims = dict(
            vocab_size=512,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
        )
    else:
        tiny = TinyModelConfig()
        dims = dict(
            vocab_size=tiny.vocab_size or len(tok),
            hidden_size=tiny.hidden_size,
            intermediate_size=tiny.intermediate_size,
            num_hidden_layers=tiny.num_layers,
            num_attention_heads=tiny.num_heads,
            num_key_value_heads=tiny.num_kv_heads,
            max_position_embeddings=tiny.max_position_embeddings,
        )
    config = transformers.LlamaConfig(
        **dims,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    torch.manual_seed(args.seed)
    model = transformers.LlamaForCausalLM(config)
    assert model.dtype == torch.float32 and model.config._attn_implementation == "eager"

    prompts = task.prompts(random.Random(args.seed), steps * P)
    longest = max(len(tok(p.text)["input_ids"]) for p in prompts)
    if longest + L > dims["max_position_embeddings"]:
        raise SystemExit(
            f"prompt ({longest} tokens) + completion ({L}) exceed max_position_embeddings "
            f"{dims['max_position_embeddings']}"
        )
    dataset = datasets.Dataset.from_dict({"prompt": [p.text for p in prompts], "answer": [p.answer for p in prompts]})

    def task_reward(prompts, completions, answer, **kwargs):
        # ``completions`` are decoded with skip_special_tokens=True, cut after the first EOS
        # (without --eos none occur because of min_new_tokens).
        return [task.score(Prompt(text=p, answer=a), c) for p, c, a in zip(prompts, completions, answer)]

    task_reward.__name__ = f"{task.name}_reward"

    clip: dict = {}
    if args.epsilon is not None:
        clip["epsilon"] = args.epsilon
    if args.epsilon_high is not None:
        clip["epsilon_high"] = args.epsilon_high

    grpo_args = GRPOConfig(
        output_dir=os.path.join(os.environ.get("TMPDIR", "/tmp"), "trl_grpo_bench"),
        # Batch shape: one generation batch of P*N completions, split into M mini-batches of
        # P*N/M, one optimizer step each (M = 1: the whole batch is one optimizer step).
        num_generations=N,
        per_device_train_batch_size=batch // M,
        steps_per_generation=M,
        gradient_accumulation_steps=1,
        num_iterations=1,
        max_steps=steps * M,
        shuffle_dataset=False,
        # Generation.
        max_completion_length=L,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        generation_kwargs=None if args.eos else {"min_new_tokens": L},
        use_vllm=False,
        # Loss / optimizer.
        beta=args.beta,
        **clip,
        loss_type=loss_type,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        optim="adamw_torch",
        adam_beta1=0.9,
        adam_beta2=beta2,
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
        seed=args.seed,
        data_seed=args.seed,
        dataloader_num_workers=0,
    )

    step_begin: list[float] = []  # per optimizer step
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

    with tempfile.TemporaryDirectory(prefix="trl_grpo_ref_") as ref_dir:
        if args.beta != 0.0:
            # TRL builds the reference model from the policy's ``_name_or_path``; a model built
            # from a config has none, so save the initial weights and point it there.
            model.save_pretrained(ref_dir)
            model.config._name_or_path = ref_dir
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=task_reward,
            args=grpo_args,
            train_dataset=dataset,
            processing_class=tok,
            callbacks=[Timer()],
        )
    if args.beta != 0.0:
        ref = trainer.ref_model
        if ref is None or not all(
            torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values())
        ):
            raise RuntimeError("the reference model is not a copy of the initial policy")

    clip_low, clip_high = trainer.epsilon_low, trainer.epsilon_high  # in effect (TRL: high defaults to low)

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

    opt_steps = steps * M
    if len(step_end) != opt_steps or len(step_begin) != opt_steps:
        raise RuntimeError(
            f"expected {opt_steps} optimizer steps, timed {len(step_begin)} begins / {len(step_end)} ends"
        )
    # One generate call per generation step, made in the first of its M optimizer steps.
    expected_calls = [i // M + 1 for i in range(opt_steps)]
    if len(gen_times) != steps or gen_calls_at_step_end != expected_calls:
        raise RuntimeError(f"expected one generate call per {M} optimizer steps, got {gen_calls_at_step_end}")
    if len(log_records) != steps:
        raise RuntimeError(f"expected {steps} logs with a reward, got {len(log_records)}")
    for entry in log_records:
        lo, hi = entry.get("completions/min_length"), entry.get("completions/max_length")
        if args.eos:
            if hi is None or hi > L:
                raise RuntimeError(f"completion longer than {L}: max {hi}")
        elif lo != L or hi != L:
            raise RuntimeError(f"completion lengths not exactly {L}: min {lo}, max {hi}")

    # Generation step i = optimizer steps [i*M, (i+1)*M).
    begins = [step_begin[i * M] for i in range(steps)]
    ends = [step_end[i * M + M - 1] for i in range(steps)]
    step_times = [e - b for b, e in zip(begins, ends)]
    measured = list(range(WARMUP_STEPS, steps)) if steps > WARMUP_STEPS else list(range(steps))
    median_step = statistics.median(step_times[i] for i in measured)
    median_gen = statistics.median(gen_times[i] for i in measured)
    mean_lengths = [entry["completions/mean_length"] for entry in log_records]
    tokens_per_step = batch * statistics.fmean(mean_lengths[i] for i in measured) if args.eos else batch * L

    rewards = [float(entry["reward"]) for entry in log_records]
    tail = max(1, round(0.1 * steps))
    final_reward = statistics.fmean(rewards[-tail:])
    smoothed = trailing_means(rewards, SMOOTH_STEPS)
    hit = next((i for i, r in enumerate(smoothed) if r >= args.target_reward), None)
    seconds_to_target = None if hit is None else round(ends[hit] - begins[0], 2)

    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    if args.eos:
        length_note = (
            f"completions stop at EOS, at most {L} tokens (checked: every logged max length <= {L}); "
            "gen_tokens_per_s = P*N*(mean completion length over the measured steps, EOS included) / "
        )
    else:
        length_note = (
            "EOS ignored via generation_kwargs min_new_tokens=L (checked: every logged completion length == L); "
            "gen_tokens_per_s = P*N*L / "
        )
    loss_note = (
        "loss_type=dapo (token mean over all completion tokens of the step, GA=1)"
        if M == 1
        else f"loss_type=bnpo (token mean over each of the {M} mini-batches of {batch // M}, "
        f"steps_per_generation={M}, GA=1)"
    )
    notes = (
        f"task {task.name}{' ' + json.dumps(options) if options else ''}; model {model_kind}; "
        + length_note
        + "median over measured steps of model.generate wall time "
        "(generate wrapped on the model instance; excludes tokenization, reward, logprob/backward/optimizer); "
        f"median_step_s = median of on_step_begin->on_step_end over steps {WARMUP_STEPS + 1}..{steps} "
        f"(step = one generation batch and its {M} optimizer step(s): generation, reward, loss fwd/bwd, optimizer); "
        f"{loss_note}; "
        f"lr {args.lr} constant, AdamW (adamw_torch, betas (0.9, {beta2}), wd 0), grad clip 1.0, "
        f"beta {args.beta} (k3 KL to the initial model), epsilon {clip_low}/{clip_high}, "
        "gradient_checkpointing off, "
        "prompts in order (shuffle_dataset=False), scale_rewards=group (TRL default), "
        f"torch threads {'set by --threads' if args.threads is not None else 'torch default'} "
        f"({torch.get_num_threads()}); "
        "first/last reward = TRL logged 'reward' of step 1 / last step; "
        f"seconds_to_target: trailing {SMOOTH_STEPS}-step mean reward >= {args.target_reward}"
    )

    return {
        "impl": "trl",
        "trl_version": trl.__version__,
        "prompts": P,
        "samples": N,
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
        "task": task.name,
        "task_options": options,
        "eos": args.eos,
        "model": model_kind,
        "lr": args.lr,
        "beta": args.beta,
        "epsilon": clip_low,
        "epsilon_high": clip_high,
        "mini_batches": M,
        "loss_type": loss_type,
        "adam_betas": [0.9, beta2],
        "seed": args.seed,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "samples_per_s": round(batch / median_step, 2),
        "total_s": round(ends[-1] - begins[0], 2),
        "target_reward": args.target_reward,
        "seconds_to_target": seconds_to_target,
        "final_reward": round(final_reward, 4),
        "mean_completion_length": round(statistics.fmean(mean_lengths), 3),
        "rewards": [round(r, 4) for r in rewards],
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
