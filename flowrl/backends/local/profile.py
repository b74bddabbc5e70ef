"""`flowrl profile`: measure this machine with the local engines and fit the cost model to it.

Measures peak matmul throughput and memory bandwidth, then times real ops of the tiny model
(decode steps at several batch sizes, forward and train passes at several sizes) and fits the
cost model's efficiency factors by least squares. Every other installed generation engine (vLLM)
is timed the same way through the runtime's engine protocol and gets decode factors and a weight
load rate of its own (``HardwareSpec.generation``), which the planner uses when it costs that
engine (``generation.engine=auto`` picks the engine it predicts fastest):

    decode step  = layers * kernel_overhead + batch * flops_per_token / (peak * matmul_eff)
    forward      = layers * kernel_overhead * calls + tokens * flops_per_token / (peak * matmul_eff)

The local backend computes in fp32, so the profile stores fp32 rates in the bf16 fields and
halves the bandwidth (the cost model counts 2 bytes per parameter).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flowrl.backends.local.device import device_capacity
from flowrl.contract.hardware import GenerationCalibration, HardwareSpec, save_hardware
from flowrl.contract.model import ModelSpec, from_tiny
from flowrl.plugins.manager import registry
from flowrl.specs import RunConfig


def _best(fn: Callable[[], Any], repeat: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def peak_flops(n: int = 1024, dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of an n x n matmul in ``dtype`` (bfloat16: native on CPUs with AVX-512-bf16 or AMX)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / _best(lambda: torch.mm(a, b))


def bandwidth(mib: int = 256) -> float:
    src = torch.empty(mib * 1024 * 1024 // 4)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _best(lambda: dst.copy_(src))


def measure_ops(
    model: Any, spec: ModelSpec, progress: Callable[[str], None] = lambda s: None
) -> dict[str, list[tuple[float, float, float]]]:
    """(batch or tokens, context, seconds) samples of decode steps, forwards and train steps."""
    from flowrl.backends.local.generation import sample

    out: dict[str, list[tuple[float, float, float]]] = {"decode": [], "forward": [], "train": []}
    prompt = 8
    for batch in (8, 64, 256, 512):
        ids = torch.randint(4, spec.vocab, (batch, prompt))
        mask = torch.ones_like(ids)
        for steps in (4, 20):
            seconds = _best(
                lambda: sample(model, ids, mask, max_new_tokens=steps, eos_id=2, pad_id=0, ignore_eos=True), repeat=3
            )
            out["decode"].append((batch, prompt + steps, seconds))
        progress(f"decode batch {batch}")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for batch in (64, 256, 512):
        for seq in (12, 40):
            ids = torch.randint(4, spec.vocab, (batch, seq))
            mask = torch.ones_like(ids)

            def fwd() -> None:
                with torch.no_grad():
                    model(input_ids=ids, attention_mask=mask).logits.log_softmax(-1)

            def train() -> None:
                opt.zero_grad()
                model(input_ids=ids, attention_mask=mask).logits.log_softmax(-1).mean().backward()
                opt.step()

            out["forward"].append((batch * seq, seq, _best(fwd, repeat=3)))
            out["train"].append((batch * seq, seq, _best(train, repeat=3)))
        progress(f"forward/train batch {batch}")
    return out


def fit(samples: dict[str, list[tuple[float, float, float]]], spec: ModelSpec, peak: float) -> tuple[float, float]:
    """Least squares for (kernel_overhead, matmul_efficiency) over decode, forward and train samples,
    with the cost model's own accounting: one layer-call per layer per forward (two with backward),
    3x the forward FLOPs with backward."""
    rows, ys = [], []
    for batch, context, seconds in samples["decode"]:
        steps = int(context) - 8  # the prefill produces the first token, then steps - 1 decode calls
        flops = batch * 8 * spec.flops_per_token(4) + sum(batch * spec.flops_per_token(8 + t) for t in range(steps - 1))
        rows.append([steps * spec.layers, flops / peak])
        ys.append(seconds)
    for tokens, seq, seconds in samples["forward"]:
        rows.append([spec.layers, tokens * spec.flops_per_token(int(seq) // 2) / peak])
        ys.append(seconds)
    for tokens, seq, seconds in samples["train"]:
        rows.append([2 * spec.layers, 3 * tokens * spec.flops_per_token(int(seq) // 2) / peak])
        ys.append(seconds)
    a = np.array(rows)
    y = np.array(ys)
    weights = 1.0 / y  # relative error matters: small and large ops count alike
    overhead, inv_eff = np.linalg.lstsq(a * weights[:, None], y * weights, rcond=None)[0]
    kernel_overhead = max(float(overhead), 1e-7)
    matmul_efficiency = float(np.clip(1.0 / inv_eff if inv_eff > 0 else 1.0, 1e-3, 1.0))
    return kernel_overhead, matmul_efficiency


def calibrate_engine(
    name: str, peak: float, progress: Callable[[str], None] = lambda s: None
) -> GenerationCalibration | None:
    """Time generation engine ``name`` through the runtime's protocol (decode at several batch
    sizes and lengths, an in-place weight load) and fit its decode factors. None when it cannot
    run here (the reason goes to ``progress``)."""
    import random

    from flowrl import api
    from flowrl.contract.data import Prompt
    from flowrl.errors import FlowRLError
    from flowrl.specs import TinyModelConfig

    overrides = [f"generation.engine={name}", "rollout.ignore_eos=true", "progress=false"]
    try:
        graph, plan = api.plan("grpo", overrides=[*overrides, "rollout.max_new_tokens=20"], emit=lambda s: None)
        trainers, generators = api.check(graph, plan).engines(graph, plan)
    except FlowRLError as exc:
        progress(f"generation engine '{name}': not calibrated ({exc})")
        return None
    trainer, engine = trainers["actor"], generators["actor"]
    spec = from_tiny(TinyModelConfig(), len(trainer.tokenizer))  # heads of 32: vLLM's CPU kernels run it
    rng = random.Random(0)
    samples = []
    for batch in (8, 64, 256):
        prompts = [Prompt(text="".join(rng.choices("abcdefgh", k=7)), answer="") for _ in range(batch)]
        for steps in (4, 20):
            seconds = _best(
                lambda: engine.generate(
                    prompts, n=1, greedy=False, generator=torch.Generator().manual_seed(0), max_new_tokens=steps
                ),
                repeat=3,
            )
            samples.append((batch, 8 + steps, seconds))
        progress(f"generation engine '{name}': decode batch {batch}")
    overhead, eff = fit({"decode": samples, "forward": [], "train": []}, spec, peak)  # decode factors only
    weights = trainer.export_weights()
    load = _best(lambda: engine.load_weights(weights, trainer.version), repeat=3)
    close = getattr(engine, "close", None)
    if close is not None:
        close()
    cal = GenerationCalibration(
        kernel_overhead=max(overhead, 1e-7),
        matmul_efficiency=eff,
        load_bandwidth=spec.parameters() * 2 / max(load, 1e-9),  # the cost model's bytes (bf16) per second
        head_sizes=tuple(getattr(engine, "head_sizes", ())),
    )
    progress(
        f"generation engine '{name}': kernel overhead {cal.kernel_overhead * 1e6:.0f} us/layer-call, matmul "
        f"efficiency {cal.matmul_efficiency:.2f}, weight load {load * 1e3:.1f} ms"
    )
    return cal


def profile(out: Path, *, progress: Callable[[str], None] = lambda s: None) -> HardwareSpec:
    from flowrl.backends.local.models import build_causal_lm, load_tokenizer, model_config
    from flowrl.specs import TinyModelConfig

    peak = peak_flops()
    half = peak_flops(dtype=torch.bfloat16)
    progress(f"matmul: {peak / 1e9:.1f} GFLOP/s float32, {half / 1e9:.1f} GFLOP/s bfloat16")
    bw = bandwidth()
    progress(f"memory bandwidth: {bw / 1e9:.1f} GB/s")
    tok = load_tokenizer(None)
    config = model_config(None, TinyModelConfig(), tok)
    model = build_causal_lm(None, config, seed=0)
    spec = from_tiny(TinyModelConfig(), len(tok))
    samples = measure_ops(model, spec, progress)
    overhead, eff = fit(samples, spec, peak)
    progress(f"fitted: kernel overhead {overhead * 1e6:.0f} us/layer-call, matmul efficiency {eff:.2f}")
    generation = {}
    for name in registry().names("generation_engines"):
        if name != RunConfig().train.engine:  # the training engine's own sampler is what the fit above measured
            cal = calibrate_engine(name, peak, progress)
            if cal is not None:
                generation[name] = cal
    hw = HardwareSpec(
        name="local-cpu",
        peak_flops_bf16=half,  # what a bfloat16 engine's matmuls reach (a float32 one's: the fp32 peak)
        peak_flops_fp32=peak,
        memory_bytes=device_capacity("cpu"),
        memory_bandwidth=bw / 2,
        intra_node_bandwidth=bw,
        inter_node_bandwidth=bw,
        devices_per_node=1,
        host_bandwidth=bw,
        matmul_efficiency=eff,
        bandwidth_efficiency=1.0,
        comm_efficiency=1.0,
        kernel_overhead=overhead,
        generation=generation,
    )
    save_hardware(hw, out)
    return hw


# ------------------------------------------------------------------ `flowrl profile` (registered as a CLI command)


def run(args: argparse.Namespace) -> int:
    from flowrl.contract.hardware import default_profile_path
    from flowrl.specs import writable

    out = writable(args.out, args.force, "--out") if args.out else default_profile_path()
    hw = profile(out, progress=lambda s: print(f"  {s}", flush=True))
    if args.out and Path(args.out).resolve() != default_profile_path().resolve():
        save_hardware(hw, default_profile_path())
    print(f"flowrl: hardware profile written to {out} (and used by `flowrl plan --cluster local` and local runs)")
    return 0
