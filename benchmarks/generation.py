"""Generated tokens/s: the vLLM engine (plugins/flowrl-vllm) against the local torch sampler, on
the same prompts, model (weights) and lengths, in one run; then GRPO step times with each.

Both engines are built from the same training engine of the default tiny Llama (heads of 32,
which vLLM's CPU kernels run); each generates ``--samples`` responses for each of ``--prompts`` prompts of
the task, ``--tokens`` tokens long (EOS ignored, so the work is equal), ``--repeats`` times; the
first call of each is a warm-up (vLLM compiles its log-prob path once). Then ``--steps`` GRPO
steps run with ``generation.engine=local`` and ``=vllm`` (each `flowrl run` in its own process),
next to the planner's predicted step for each (calibrated by `flowrl profile` where it ran).
The last line is JSON.

    python benchmarks/generation.py --prompts 16 --samples 8 --tokens 32 --steps 30
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from flowrl import api
from flowrl.contract.protocols import EngineContext
from flowrl.tasks.builtin import make_task


def _throughput(engine, prompts, samples: int, repeats: int) -> float:
    rates = []
    for r in range(repeats + 1):
        start = time.perf_counter()
        out = engine.generate(prompts, n=samples, greedy=False, generator=torch.Generator().manual_seed(r))
        seconds = time.perf_counter() - start
        if r:  # the first call warms up
            rates.append(float(out.sequences.response_mask.sum()) / seconds)
    return statistics.median(rates)


def _grpo_step_s(engine: str, steps: int, base: list[str]) -> tuple[float, float | None]:
    """(measured median step, the planner's predicted step) of GRPO generating with ``engine``,
    run as a user runs it: `flowrl run` in a process of its own (vLLM in that process)."""
    sets = [*base, f"generation.engine={engine}", "checkpoint=false"]
    _, plan = api.plan("grpo", overrides=sets, emit=lambda s: None)
    predicted = plan.layout.predicted.iteration_s if plan.layout and plan.layout.predicted else None
    with tempfile.TemporaryDirectory() as out:
        flags = [f"--set={s}" for s in sets]
        subprocess.run(
            [sys.executable, "-m", "flowrl", "run", "grpo", "--steps", str(steps), "--out", out, "--quiet", *flags],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        metrics = [json.loads(line) for line in (Path(out) / "grpo" / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_seconds"] for r in metrics[2:]), predicted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    from flowrl_vllm.engine import VLLMEngine

    base = ["progress=false"]  # the default tiny model: heads of 32, which vLLM's CPU kernels run
    sampling = [*base, f"rollout.max_new_tokens={args.tokens}", "rollout.ignore_eos=true"]
    graph, plan = api.plan("grpo", overrides=sampling, emit=lambda s: None)
    trainers, _ = api.check(graph, plan).engines(graph, plan)
    local = trainers["actor"]
    vllm = VLLMEngine(
        EngineContext(decl=graph.models["actor"], spec=plan.model_run("actor"), device="cpu", source=local)
    )
    prompts = make_task(plan.config.task).prompts(random.Random(0), args.prompts)
    local_tps = _throughput(local, prompts, args.samples, args.repeats)
    vllm_tps = _throughput(vllm, prompts, args.samples, args.repeats)
    print(f"generation: local {local_tps:,.0f} tok/s, vllm {vllm_tps:,.0f} tok/s ({vllm_tps / local_tps:.2f}x)")
    step_local, pred_local = _grpo_step_s("local", args.steps, base)
    step_vllm, pred_vllm = _grpo_step_s("vllm", args.steps, base)
    print(f"GRPO median step: local {step_local:.3f} s, vllm {step_vllm:.3f} s ({step_local / step_vllm:.2f}x)")
    print(f"planner's prediction: local {pred_local} s, vllm {pred_vllm} s (`flowrl profile` calibrates both)")
    print(
        json.dumps(
            {
                "bench": "generation",
                "prompts": args.prompts,
                "samples": args.samples,
                "tokens": args.tokens,
                "local_tok_s": round(local_tps, 1),
                "vllm_tok_s": round(vllm_tps, 1),
                "vllm_over_local": round(vllm_tps / local_tps, 3),
                "grpo_step_local_s": round(step_local, 4),
                "grpo_step_vllm_s": round(step_vllm, 4),
                "grpo_local_over_vllm": round(step_local / step_vllm, 3),
                "grpo_step_local_predicted_s": pred_local and round(pred_local, 4),
                "grpo_step_vllm_predicted_s": pred_vllm and round(pred_vllm, 4),
            }
        )
    )


if __name__ == "__main__":
    main()
