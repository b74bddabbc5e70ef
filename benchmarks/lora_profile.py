"""Where a LoRA step's time goes, beside full fine-tuning of the same job, phase by phase.

One GRPO step of the real-model benchmark (benchmarks/real_model.py: SmolLM2-135M-Instruct, chat
prompts of arithmetic word problems, P prompts x S samples x T new tokens, bfloat16 autocast and
eager attention as flowrl's CPU ``auto`` picks) taken apart into what the engine does, with the
engine's own pieces (`flowrl.backends.local`: `sample`, `add_lora`, `adapters_off`, `adamw`):

- ``generate``: sampling the rollout (prefill + T decode steps, the lean decoder);
- ``old_logprobs``: a no-grad forward of the trained model over prompt + response;
- ``reference``: the same for the reference policy -- a LoRA model's own module with its adapters
  off, a full fine-tune's frozen copy;
- ``train``: forward + backward of a token-mean policy-gradient loss;
- ``optimizer``: grad-norm clipping and AdamW's step.

Variants (``--variants``): ``full``; ``lora`` (rank 16 on every projection, as the engine builds it);
``lora-cast`` (lora, its frozen base weights marked as requiring grad while it samples, so autocast
keeps their bfloat16 casts for the whole generation instead of casting every weight at every
decode step -- torch caches an autocast cast only for a leaf that requires grad); ``lora-merged``
(lora, sampling with the adapters merged into a bfloat16 copy of the weights, no LoRA matmuls while
decoding); ``lora-bf16`` (lora, the adapted layers' frozen base weights stored in bfloat16, which
is what autocast computes them in anyway: no per-pass casts in any phase, same logits);
``lora-engine`` (what the engine does since: lora-bf16's storage, and sampling under autocast from
`lora.MergedCopy`, the adapters merged into bfloat16 linear weights once per train step). Each variant
runs in its own process (``--one``), one after another, and reports its peak RSS; the last line
is JSON with the per-phase medians (wall and CPU seconds) and each variant's ratio to ``full``.

    python benchmarks/lora_profile.py                       # 8 x 4 x 48, 2 timed steps each
    python benchmarks/lora_profile.py --reps 3 --variants full,lora
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PHASES = ("generate", "old_logprobs", "reference", "train", "optimizer")


def prompts(tokenizer, count: int, seed: int) -> list[str]:
    sys.path.insert(0, str(HERE))
    from real_model import SYSTEM, problem

    rng = random.Random(seed)
    out = []
    for _ in range(count):
        chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": problem(rng)["question"]}]
        out.append(tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    return out


def one(args: argparse.Namespace) -> dict:
    """One variant in this process: per-phase seconds of ``args.reps`` steps after a warm-up step."""
    import torch

    from flowrl.backends.local.generation import last_logits_only, sample
    from flowrl.backends.local.models import build_causal_lm, load_tokenizer
    from flowrl.backends.local.parallelize.lora import adapters_off, add_lora
    from flowrl.specs import LoraConfig

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    variant = args.one
    tok = load_tokenizer(str(args.model))
    model = build_causal_lm(str(args.model), _config(args.model), args.seed)  # eager attention
    lora = variant.startswith("lora")
    if lora:
        add_lora(model, LoraConfig(rank=args.rank, alpha=args.alpha), args.seed, "actor")
        reference = None
        if variant in ("lora-bf16", "lora-engine"):  # the frozen base in the precision autocast computes it in
            from flowrl.backends.local.parallelize.lora import store_base

            store_base(model, torch.bfloat16)
    else:
        model.requires_grad_(True)
        import copy

        reference = copy.deepcopy(model).requires_grad_(False).eval()
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0, fused=True)  # as the engine
    model.eval()
    texts = [t for t in prompts(tok, args.prompts, args.seed) for _ in range(args.samples)]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    gen = torch.Generator().manual_seed(args.seed)
    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    base = [p for n, p in model.named_parameters() if not p.requires_grad]
    merged = None
    steps = [0]  # optimizer steps taken: the key of the engine variant's merged copy

    def generate():
        with contextlib.ExitStack() as stack:
            if variant == "lora-cast":  # autocast caches casts of leaves that require grad
                stack.enter_context(_requiring_grad(base))
            if variant == "lora-merged":
                module = _merged_bf16(model, args.alpha / args.rank)
            elif variant == "lora-engine":
                nonlocal merged
                if merged is None:
                    from flowrl.backends.local.parallelize.lora import MergedCopy

                    merged = MergedCopy(model, torch.bfloat16)
                module = merged.refresh(args.alpha / args.rank, steps[0])
                stack.enter_context(bf16())
            else:
                module = model
                stack.enter_context(bf16())
            return sample(
                module, enc["input_ids"], enc["attention_mask"], max_new_tokens=args.tokens,
                eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, ignore_eos=True, generator=gen,
            )  # fmt: skip

    def rows(tokens):
        ids = torch.cat([enc["input_ids"], tokens], 1)
        mask = torch.cat([enc["attention_mask"], torch.ones_like(tokens)], 1)
        return ids, mask

    def logprobs(module, ids, mask, tokens):  # the engine's forward: the LM head on the response positions only
        keep = last_logits_only(module, tokens.shape[1] + 1)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = module(input_ids=ids, attention_mask=mask, position_ids=pos, **keep).logits[:, :-1]
        return torch.log_softmax(logits.float(), -1).gather(-1, tokens[..., None]).squeeze(-1)

    times: dict[str, list[float]] = {p: [] for p in PHASES}
    cpu: dict[str, list[float]] = {p: [] for p in PHASES}
    for rep in range(args.reps + 1):
        t: dict[str, tuple[float, float]] = {}
        with _timed(t, "generate"):
            tokens, _, _ = generate()
        ids, mask = rows(tokens)
        with _timed(t, "old_logprobs"), torch.no_grad(), bf16():
            old = logprobs(model, ids, mask, tokens).float()
        with _timed(t, "reference"), torch.no_grad(), bf16():
            with adapters_off(model) if lora else contextlib.nullcontext():
                logprobs(model if lora else reference, ids, mask, tokens).float()
        adv = torch.randn(len(texts), 1)
        with _timed(t, "train"):
            model.train()
            with bf16():
                new = logprobs(model, ids, mask, tokens).float()
            loss = -((new - old).exp() * adv).mean()
            loss.backward()
            model.eval()
        with _timed(t, "optimizer"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            steps[0] += 1
        if rep:  # the first step warms up (allocations, the first AdamW state)
            for k, (wall, used) in t.items():
                times[k].append(wall)
                cpu[k].append(used)
        line = " ".join(f"{k} {w:.2f}/{c:.2f}" for k, (w, c) in t.items())
        print(f"{variant} step {rep} (wall/cpu s): {line}", file=sys.stderr, flush=True)

    def medians(of: dict[str, list[float]]) -> dict[str, float]:
        out = {k: round(statistics.median(v), 3) for k, v in of.items()}
        out["step"] = round(sum(out[p] for p in PHASES), 3)
        return out

    return {
        "variant": variant,
        "seconds": medians(times),
        "cpu_seconds": medians(cpu),
        "spread": {k: round(max(v) - min(v), 3) for k, v in times.items()},
        "trained_parameters": sum(p.numel() for p in trained),
        "optimizer_state_tensors": sum(len(s) for s in opt.state.values()),
        "optimizer_state_mb": round(
            sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if v.dim()) / 2**20, 1
        ),
    }


@contextlib.contextmanager
def _timed(into: dict, phase: str):
    """Wall and CPU seconds (this process's, all threads) of the block, into ``into[phase]``; on a shared
    box CPU seconds of a one-thread run are the steadier measure."""
    wall, used = time.perf_counter(), time.process_time()
    yield
    into[phase] = (time.perf_counter() - wall, time.process_time() - used)


def _config(folder: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder, local_files_only=True)


@contextlib.contextmanager
def _requiring_grad(params):
    import torch

    for p in params:
        p.requires_grad_(True)
    try:
        with torch.no_grad():
            yield
    finally:
        for p in params:
            p.requires_grad_(False)


_MERGED: dict = {}  # a LoRA model's merged bfloat16 copy (not an attribute: a module would register it)


def _merged_bf16(model, scaling: float):
    """A bfloat16 copy of ``model`` with its adapters merged (a plain Llama, what the lean decoder runs)."""
    import torch

    from flowrl.backends.local.models import build_causal_lm
    from flowrl.backends.local.parallelize.lora import merge_lora

    cache = _MERGED.get(id(model))
    if cache is None:
        cache = build_causal_lm(None, model.config, 0).to(torch.bfloat16).eval()
        cache.requires_grad_(False)
        _MERGED[id(model)] = cache
    state = merge_lora({k: v.detach() for k, v in model.state_dict().items()}, scaling)
    with torch.no_grad():
        cache.load_state_dict(state)  # copy_ casts to bfloat16
    return cache


def run_variant(args: argparse.Namespace, variant: str) -> dict:
    """``variant`` in a process of its own; its result and peak RSS (os.wait4: that child's own)."""
    out = Path(f"/tmp/lora_profile_{os.getpid()}_{variant}.json")
    cmd = [sys.executable, __file__, "--one", variant, "--json", str(out)]
    for k in ("model", "prompts", "samples", "tokens", "reps", "rank", "alpha", "lr", "seed", "threads"):
        cmd += [f"--{k}", str(getattr(args, k))]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.Popen(cmd, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        print(f"variant {variant} failed (wait status {status})", file=sys.stderr)
        return {"variant": variant, "failed": status}
    result = json.loads(out.read_text())
    out.unlink()
    result["peak_rss_mb"] = round(usage.ru_maxrss / 1024, 1)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=Path.home() / ".cache" / "flowrl-bench" / "smollm2-135m-instruct")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--reps", type=int, default=2, help="timed steps per variant (after one warm-up step)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=16.0)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: one core; OpenMP threads spin on a shared box)"
    )
    p.add_argument("--variants", default="full,lora,lora-cast,lora-merged")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        args.json.write_text(json.dumps(one(args)))
        return
    if not (args.model / "config.json").is_file():
        sys.exit(f"no model in {args.model}: python benchmarks/real_model.py makes it (--cache)")
    results = {v: run_variant(args, v) for v in args.variants.split(",")}
    if "full" in results and "failed" not in results["full"]:
        full = results["full"]
        for r in (r for r in results.values() if "failed" not in r):
            r["step_ratio"] = round(r["seconds"]["step"] / full["seconds"]["step"], 3)
            r["cpu_ratio"] = {k: round(v / full["cpu_seconds"][k], 3) for k, v in r["cpu_seconds"].items()}
            r["rss_ratio"] = round(r["peak_rss_mb"] / full["peak_rss_mb"], 3)
    job = {"prompts": args.prompts, "samples": args.samples, "tokens": args.tokens, "rank": args.rank}
    job["threads"] = args.threads
    print(json.dumps({"job": job, **results}))


if __name__ == "__main__":
    main()
