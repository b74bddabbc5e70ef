"""The Ray backend as a user meets it (issue 7): checkpoints of every
placement load and hold the trainer's final weights, worker errors read as one paragraph,
a one-device Ray plan runs on this machine's CPU, traces are valid Chrome traces, and the
in-process local backend still runs. A run checks what it can: the colocated PPO run's trace is the
Chrome trace checked, the disaggregated run's 'full' weight sync is checked after every step.

One Ray session serves the module (the executor joins it instead of starting its own); the
CLI tests start their own private Ray in a subprocess and check that it is gone afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import cpu_plan

from flowrl import api
from flowrl.errors import BackendError

ray = pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "progress=false"]
CLI_SMALL = ["--steps", "2", "--set", "rollout.prompts_per_step=4", "--set", "rollout.samples_per_prompt=4", "--quiet"]


# one private Ray for the module (tests/conftest.py); runs end to end on Ray workers
pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.slow]


def plan_for(graph: str, out: Path, *extra: str, devices: int = 2, require: tuple[str, ...] = (), **pins: str):
    """A plan of ``graph`` for this machine as ``devices`` CPU devices, for the Ray executor."""
    return cpu_plan(graph, [*SMALL, f"out={out}", *extra], devices, require, **pins)


def run_capturing_final_weights(g, plan, out: Path) -> tuple[Any, dict[str, dict[str, torch.Tensor]]]:
    """Run ``plan``; returns the result and, per trainable model, the trainer's full weights
    after the last step (nothing changes them between the last step and the checkpoint). After
    every step's weight sync, the generation replicas must hold the trainer's weights bit for bit."""
    ex = api.check(g, plan)
    final: dict[str, dict[str, torch.Tensor]] = {}
    synced: list[int] = []

    def on_step(record):
        for m in ex.lowered.models:
            if g.models[m.model].trainable:
                ranks = list(ex.lowered.ranks_of(m.model))
                final[m.model] = ex.transport.call(ranks, "export_weights", [(m.model,)] * len(ranks), "check")[0]
            gen = list(ex.lowered.generation_ranks(m.model))
            if gen:  # after the step's weight sync the replicas sample with the trained weights, bit for bit
                for rank, held in zip(gen, ex.transport.call(gen, "generation_weights", [(m.model,)] * len(gen), "")):
                    assert held.keys() == final[m.model].keys(), f"rank {rank}: '{m.model}' replica has other keys"
                    for k, v in final[m.model].items():
                        assert torch.equal(held[k], v), f"rank {rank}: '{m.model}' replica differs at '{k}'"
                synced.append(record["step"])

    out.mkdir(parents=True, exist_ok=True)
    result = api.run(g, plan, executor=ex, out_dir=out, on_step=on_step)
    if any(ex.lowered.generation_ranks(m.model) for m in ex.lowered.models):
        assert sorted(set(synced)) == list(range(plan.config.steps))  # checked after every step's sync
    return result, final


def checkpoint_weights(path: Path) -> dict[str, torch.Tensor]:
    """What a checkpoint folder holds, keyed as the engine's state dict (LM, or critic backbone + head)."""
    from safetensors.torch import load_file

    names = sorted(p.name for p in path.iterdir())
    assert "config.json" in names and "model.safetensors" in names, f"{path} is not a loadable checkpoint: {names}"
    if (path / "value_head.safetensors").exists():
        weights = {f"backbone.{k}": v for k, v in load_file(str(path / "model.safetensors")).items()}
        weights.update({f"head.{k}": v for k, v in load_file(str(path / "value_head.safetensors")).items()})
        return weights
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True).state_dict()


def assert_checkpoints_hold(result, final: dict[str, dict[str, torch.Tensor]]) -> None:
    assert set(result.checkpoints) == set(final)
    for model, path in result.checkpoints.items():
        held, want = checkpoint_weights(path), final[model]
        assert held.keys() == want.keys(), (model, sorted(held.keys() ^ want.keys())[:5])
        for k in want:
            assert torch.equal(held[k], want[k]), f"checkpoint of '{model}': '{k}' differs from the trainer's"


def assert_chrome_trace(path: Path) -> dict[str, Any]:
    """The Chrome trace event format as Perfetto imports it: complete events with ts, dur >= 0
    (Perfetto drops events with negative timestamps), every pid named."""
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    named = {e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    spans = [e for e in events if e["ph"] == "X"]
    assert spans
    for e in spans:
        assert isinstance(e["name"], str) and e["name"], e
        assert e["pid"] in named, e
        assert e["ts"] >= 0, f"negative timestamp (Perfetto drops it): {e}"
        assert e["dur"] >= 0, e
    return trace


# ------------------------------------------------------------------ checkpoints


def test_disaggregated_checkpoint_is_a_loadable_model_with_the_trainers_final_weights(tmp_path):
    """The trainer lives on rank 1 (group 'train' starts at rank 1): its checkpoint must still be
    written in full (HF `save_pretrained` writes only on torch.distributed rank 0). Two steps: the
    'full' weight sync leaves the replica equal to the trainer bit for bit after each (the other
    strategies: tests/ray/test_ray_backend.py)."""
    g, plan = plan_for("grpo", tmp_path, "steps=2", "checkpoint=true", placement="disaggregated", weight_sync="full")
    assert plan.layout.layout("actor").group == "train" and plan.layout.weight_sync.strategy == "full"
    result, final = run_capturing_final_weights(g, plan, tmp_path / "run")
    assert all(m["sync:train_actor/bytes"] > 0 for m in result.metrics)
    assert_checkpoints_hold(result, final)


def test_split_ppo_critic_checkpoint_holds_its_backbone_and_head(tmp_path):
    """PPO split: actor + ref on rank 0, the critic alone on rank 1."""
    g, plan = plan_for("ppo", tmp_path, "steps=1", "checkpoint=true", placement="split")
    assert plan.layout.placement == "split" and plan.layout.layout("critic").group != plan.layout.layout("actor").group
    result, final = run_capturing_final_weights(g, plan, tmp_path / "run")
    line = json.loads((result.out_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert line["reward"] is not None and "train_critic/loss" in line and "values" in line["spans"]
    assert_checkpoints_hold(result, final)


def test_colocated_dp2_ppo_with_frozen_reference_checkpoints_match_the_sharded_trainers(tmp_path):
    """Its trace.json is a Chrome trace Perfetto keeps whole: worker setup spans happen before the
    trace's origin, and they must not get negative timestamps."""
    g, plan = plan_for(
        "ppo", tmp_path, "steps=1", "checkpoint=true", placement="colocate", require=("actor.dp=2", "critic.dp=2")
    )
    assert all(m.parallel.dp == 2 for m in plan.layout.models)  # ref is frozen and replicated, actor/critic FSDP2
    result, final = run_capturing_final_weights(g, plan, tmp_path / "run")
    assert_checkpoints_hold(result, final)
    folder = result.out_dir
    workers = json.loads((folder / "workers.json").read_text())
    assert [w["rank"] for w in workers] == [0, 1] and {w["group"] for w in workers} == {"all"}
    line = json.loads((folder / "metrics.jsonl").read_text())
    assert line["step"] == 0 and line["sync:train_actor/strategy"] == "reshard" and line["sync:train_actor/bytes"] > 0
    assert (folder / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    trace = assert_chrome_trace(folder / "trace.json")
    assert {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"} >= {0, 1, 2}  # the driver and both ranks


# ------------------------------------------------------------------ the run folder


def test_zero_steps_still_writes_the_run_folder_the_readme_promises(tmp_path):
    """README: every run folder gets trace.json and timeline.png (the predicted timeline at least)."""
    g, plan = plan_for("grpo", tmp_path, "steps=0", "checkpoint=true", placement="colocate")
    result = api.run(g, plan, out_dir=tmp_path / "run")
    folder = result.out_dir
    assert result.metrics == [] and (folder / "metrics.jsonl").read_text() == ""
    assert json.loads((folder / "trace.json").read_text())["traceEvents"]
    assert (folder / "checkpoint" / "model.safetensors").exists()
    assert (folder / "timeline.png").exists()


# ------------------------------------------------------------------ errors


def test_a_user_error_inside_a_worker_reads_as_one_paragraph(tmp_path):
    """A BackendError raised in a worker (a diverged step) keeps its message, not Ray's traceback."""
    # a batch large enough that its first step's rewards differ (a constant-reward batch has no gradient to
    # diverge on, and after a KL-only update at lr 1e9 the saturated policy has none either)
    g, plan = plan_for(
        "grpo", tmp_path, "steps=3", "checkpoint=false", "train.lr=1e9", "rollout.prompts_per_step=8",
        "rollout.samples_per_prompt=8", placement="colocate",
    )  # fmt: skip
    with pytest.raises(BackendError) as info:
        api.run(g, plan, out_dir=tmp_path / "run")
    msg = str(info.value)
    assert "(norm nan) is not finite" in msg
    assert "Traceback" not in msg and 'File "' not in msg and "\x1b[" not in msg and "ray::" not in msg, msg
    assert msg.startswith("node 'train_actor'"), msg
    assert ray.is_initialized()  # the module's session: not the executor's to stop
    deadline = time.time() + 20  # the workers and their placement groups are gone
    while ray.available_resources().get("CPU", 0) < 2 and time.time() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == 2


def test_one_device_ray_plan_on_a_cpu_machine_runs_on_cpu(tmp_path, monkeypatch):
    """`flowrl run graphs/grpo.py --backend ray` (and `--cluster cpu:1`) plans for this machine's
    CPU; the Ray executor must run it there instead of asking for a GPU."""
    import flowrl_ray.executor as ray_executor

    monkeypatch.setattr(ray_executor, "PLACEMENT_TIMEOUT_S", 5.0)  # a GPU bundle would otherwise wait 60 s
    overrides = [*SMALL, "backend=ray", "device=cpu", "steps=1", "checkpoint=false", f"out={tmp_path}"]
    g, plan = api.plan("grpo", overrides=overrides, emit=lambda s: None)
    ex = api.check(g, plan)
    assert ex.device(plan) == "cpu"
    result = api.run(g, plan, executor=ex, out_dir=tmp_path / "run")
    assert [m["step"] for m in result.metrics] == [0]


# ------------------------------------------------------------------ the local backend


def test_the_in_process_local_backend_still_runs(tmp_path):
    overrides = [*SMALL, "backend=local", "device=cpu", "steps=1", "checkpoint=true", f"out={tmp_path}"]
    g, plan = api.plan("grpo", overrides=overrides, emit=lambda s: None)
    assert plan.layout.placement == "colocate" and plan.target.cluster.devices == 1
    result = api.run(g, plan, out_dir=tmp_path / "run")
    folder = result.out_dir
    assert [m["step"] for m in result.metrics] == [0] and result.metrics[0]["reward"] is not None
    assert not (folder / "workers.json").exists()
    assert (folder / "checkpoint" / "model.safetensors").exists()
    assert_chrome_trace(folder / "trace.json")
    assert ray.is_initialized()


# ------------------------------------------------------------------ the CLI


def flowrl(*args: str, plugins: str = "ray", cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "FLOWRL_PLUGINS": plugins, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    return subprocess.run(
        [sys.executable, "-m", "flowrl.cli", *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=600
    )


def raylets() -> set[int]:
    out = subprocess.run(["pgrep", "-f", "raylet"], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


def one_paragraph(stderr: str) -> bool:
    return "Traceback" not in stderr and 'File "' not in stderr and "\x1b[" not in stderr


def test_cli_worker_error_exits_2_in_one_paragraph_and_leaves_no_ray(tmp_path):
    before = raylets()
    out = flowrl(
        "run", "graphs/ppo.py", "--cluster", "cpu:2", "--placement", "colocate", *CLI_SMALL, "--out", str(tmp_path),
        "--set", "train.lr=1e9",
    )  # fmt: skip
    # PPO: the critic's baseline gives every row an advantage, so the first step's gradient is never zero (GRPO's
    # is when no sample of the tiny model scores, as happens by chance), and lr 1e9 makes the loss non-finite
    time.sleep(1)
    assert not (raylets() - before), "a raylet of the failed run is still running"
    assert out.returncode == 2, out.stderr
    assert "(norm nan) is not finite" in out.stderr
    assert one_paragraph(out.stderr), out.stderr


def test_cli_plan_mistakes_exit_2_in_one_paragraph(tmp_path, monkeypatch, capsys):
    """`flowrl plan` then `flowrl run --plan` without the plugin, in this process (neither starts a Ray)."""
    from flowrl.cli import main
    from flowrl.plugins.manager import set_registry

    plan = tmp_path / "plan.yaml"
    made = main(["plan", "graphs/grpo.py", "--cluster", "cpu:2", "--out", str(plan), *CLI_SMALL[:-1]])
    assert made == 0, capsys.readouterr().err
    capsys.readouterr()
    monkeypatch.setenv("FLOWRL_PLUGINS", "")  # the plan is for 'ray'; its plugin is not loaded
    set_registry(None)
    rc = main(["run", "graphs/grpo.py", "--plan", str(plan)])
    err = capsys.readouterr().err
    assert rc == 2 and "'ray'" in err and one_paragraph(err)
