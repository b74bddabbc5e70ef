"""The planner's memory estimate against what a run really holds, per engine configuration; one JSON line.

For each configuration (fp32, bf16, bf16 + recompute, LoRA) a GRPO job on the local executor runs
a few steps in a process of its own, on a mid-size tiny Llama (so that model states and activations,
not the interpreter, dominate). Measured: the peak RSS while the run's models generate, score and
train (``VmHWM``, reset before each engine call) minus the RSS just before the run builds any model,
after a one-step warm-up run (everything a run imports is imported) -- with glibc returning freed
blocks to the system (``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``), so that RSS counts
live tensors as torch's allocator statistics would on a GPU (torch keeps none on CPU). Predicted:
the plan's per-group memory estimate (`flowrl plan` prints it). ``ratio`` = measured / predicted;
the issue asks for it within 15 %. Each configuration also reports its largest phase (the engine
call with the highest peak).

``ray-cpu2`` runs the fp32 job as a Ray plan for this machine as two devices (``cpu:2``: the actor
FSDP2-sharded over two worker processes), ``ray-cpu2-tp2`` with the actor split tensor-parallel over
them instead (the tuner's pick for this model once the engine runs tp): measured per worker process
from its ``/proc`` status around each call the driver makes to it, from the worker's RSS after a
warm-up in it (a tiny model built, trained a step and dropped); predicted, the plan's estimate for
one device of the group.

    python benchmarks/memory_fidelity.py --steps 2 --prompts 8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CONFIGS = {
    "fp32": ["train.dtype=float32"],  # auto takes bfloat16 for this model on a CPU with native bfloat16
    "bf16": ["train.dtype=bfloat16", "train.attention=sdpa"],
    "bf16+recompute": ["train.dtype=bfloat16", "train.attention=sdpa", "train.recompute=true"],
    "lora": ["train.dtype=float32", "train.lora.rank=8"],
    "ray-cpu2": ["train.dtype=float32", "backend=ray", "device=cpu"],
    "ray-cpu2-tp2": ["train.dtype=float32", "backend=ray", "device=cpu"],
}
# the layout a Ray row requires (`flowrl plan --require`): the actor FSDP2-sharded over both ranks, or split
# tensor-parallel over them
REQUIRE = {"ray-cpu2": ["actor.dp=2"], "ray-cpu2-tp2": ["actor.tp=2"]}
MODEL = [
    "tiny_model.hidden_size=512",
    "tiny_model.intermediate_size=1408",
    "tiny_model.num_layers=6",
    "tiny_model.num_heads=8",
    "tiny_model.num_kv_heads=4",
]

CHILD = r"""
import ctypes, gc, json, sys
from flowrl import api
from flowrl.backends.local import engine

def status(field):
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(field + ":"))

def reset_peak():
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # the peak RSS (VmHWM) starts again from the RSS now

def settle():
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)

overrides = json.loads(sys.argv[1])
warm = [o for o in overrides if not o.startswith("steps=")] + ["steps=1"]
api.run(*api.plan("graphs/grpo.py", overrides=warm, emit=lambda s: None))
settle()
graph, plan = api.plan("graphs/grpo.py", overrides=overrides, emit=lambda s: None)
(estimate,) = plan.memory
settle()
base = status("VmRSS")
phases = {}

def measured(name):
    call = getattr(engine.LocalModel, name)
    def run(self, *args, **kwargs):
        reset_peak()
        out = call(self, *args, **kwargs)
        key = f"{self.decl.name}.{name}"
        phases[key] = max(phases.get(key, 0), status("VmHWM") - base)
        return out
    setattr(engine.LocalModel, name, run)

for name in ("generate", "forward", "train"):
    measured(name)
api.run(graph, plan)
print(json.dumps({"predicted": estimate.required_bytes, "breakdown": estimate.breakdown, "phases": phases}))
"""


RAY_CHILD = r"""
import ctypes, gc, json, sys
from flowrl import api
from flowrl.planner.constraints import parse_requirements
from flowrl.plugins.manager import registry
from flowrl_ray import executor as rx

def status(pid, field):
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(field + ":"))

def reset_peak(pid):
    with open(f"/proc/{pid}/clear_refs", "w") as fh:
        fh.write("5")

def warm(_self):  # in a worker, as the local run's warm-up: a tiny model built, run and dropped
    import torch, torch.distributed.fsdp, peft  # noqa: F401
    from flowrl.backends.local.models import build_causal_lm, load_tokenizer, model_config
    from flowrl.specs import TinyModelConfig
    tok = load_tokenizer(None)
    model = build_causal_lm(None, model_config(None, TinyModelConfig(), tok), seed=0)
    ids = torch.randint(0, len(tok), (2, 8))
    model(input_ids=ids).logits.sum().backward()
    torch.optim.AdamW(model.parameters()).step()
    del model
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return True

overrides, required = json.loads(sys.argv[1]), json.loads(sys.argv[2])
graph, cfg = api.load("graphs/grpo.py", overrides=overrides)
target = api.local_target(cfg, registry(), devices=2)
options = {"require": parse_requirements(required, graph.models)}
graph, plan = api.plan(
    "graphs/grpo.py", overrides=overrides, target=target, for_backend=True, options=options, emit=lambda s: None
)
estimates = {m.group: m.required_bytes for m in plan.memory}
base, phases = {}, {}
call = rx.RayTransport.call

def measured(self, ranks, method, args, tag):
    import ray
    if method == "setup":
        ray.get([self.actors[r].__ray_call__.remote(warm) for r in ranks])
        for r in ranks:
            base[r] = status(self.pids[r], "VmRSS")
    pids = {r: self.pids[r] for r in ranks if r in base}
    for pid in pids.values():
        reset_peak(pid)
    out = call(self, ranks, method, args, tag)
    for r, pid in pids.items():
        key = f"{self.group_of(r)}.{method}"
        phases[key] = max(phases.get(key, 0), status(pid, "VmHWM") - base[r])
    return out

rx.RayTransport.call = measured
api.run(graph, plan)
group, predicted = max(estimates.items(), key=lambda kv: kv[1])
print(json.dumps({"predicted": predicted, "phases": {k: v for k, v in phases.items() if k.startswith(group)},
                  "layout": plan.layout.summary()}))
"""


def measure(name: str, steps: int, prompts: int) -> dict:
    overrides = [
        f"steps={steps}", "seed=0", "progress=false", "checkpoint=false", "out=/tmp/flowrl-memory",
        f"rollout.prompts_per_step={prompts}", "threads=2", *MODEL, *CONFIGS[name],
    ]  # fmt: skip
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}
    child = RAY_CHILD if name.startswith("ray") else CHILD
    args = [json.dumps(overrides), json.dumps(REQUIRE.get(name, []))]
    proc = subprocess.run([sys.executable, "-c", child, *args], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"configuration {name} failed:\n{proc.stderr[-3000:]}")
    out = proc.stdout
    record = json.loads(out.strip().splitlines()[-1])
    record["phase"], record["measured"] = max(record["phases"].items(), key=lambda kv: kv[1])
    record["ratio"] = round(record["measured"] / record["predicted"], 3)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS))
    args = parser.parse_args()
    results = {}
    for name in args.configs:
        results[name] = measure(name, args.steps, args.prompts)
        r = results[name]
        mib = {k: r[k] / 2**20 for k in ("predicted", "measured")}
        print(
            f"{name:16s} predicted {mib['predicted']:8.1f} MiB  measured {mib['measured']:8.1f} MiB  ratio {r['ratio']}"
        )
    print(
        json.dumps(
            {
                "benchmark": "memory_fidelity",
                "steps": args.steps,
                "prompts": args.prompts,
                **{
                    name: {
                        "predicted_mib": round(r["predicted"] / 2**20, 1),
                        "measured_mib": round(r["measured"] / 2**20, 1),
                        "ratio": r["ratio"],
                        "peak_phase": r["phase"],
                        **({"layout": r["layout"]} if "layout" in r else {}),
                    }
                    for name, r in results.items()
                },
            }
        )
    )


if __name__ == "__main__":
    main()
