"""kill -9 at any moment, Ctrl-C and SIGTERM, from the CLI: the run folder stays consistent after
every interruption (metrics parseable up to the last complete step, every checkpoint whole),
and after resuming to the end the run equals one that was never interrupted, bit for bit: no
step or prompt lost or used twice."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from flowrl import api
from flowrl.runtime import checkpoint

pytestmark = pytest.mark.slow  # flowrl subprocesses, killed and resumed

STEPS = 14
RUN = ["--steps", str(STEPS), "--save-every", "1", "--quiet", "--set", "rollout.prompts_per_step=4"]
TIMING = ("step_seconds", "tokens_per_s", "spans")


def _lines(folder: Path) -> list[str]:
    path = folder / "metrics.jsonl"
    return path.read_text().split("\n") if path.is_file() else []


def _complete(folder: Path) -> list[dict]:
    """The complete records; only a last, half-written line may fail to parse."""
    lines = _lines(folder)
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            assert i == len(lines) - 1, f"line {i} of metrics.jsonl is broken, and it is not the last"
    return records


def _stripped(folder: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING and not k.endswith("/seconds")} for r in _complete(folder)]


def _consistent(folder: Path) -> int:
    """Check the folder after an interruption; returns the newest checkpoint's step (-1: none)."""
    records = _complete(folder)
    assert [r["step"] for r in records] == list(range(len(records)))
    found = checkpoint.listed(folder)
    for step, path in found:  # every checkpoint that is there is whole and loads
        assert json.loads((path / checkpoint.STATE).read_text())["step"] == step
        checkpoint.load_tree(path / "driver")
        assert load_file(str(path / "models" / "actor" / "model.safetensors"))
        checkpoint.load_tree(path / "models" / "actor" / "optimizer")
        assert step < len(records)  # a checkpoint comes after its step's metrics
    return found[-1][0] if found else -1


def _wait_for(proc: subprocess.Popen, ready) -> bool:
    """Poll ``ready()`` every millisecond while ``proc`` runs; False when it ended first."""
    while proc.poll() is None:
        if ready():
            return True
        time.sleep(0.001)
    return False


def test_kill_9_ctrl_c_and_sigterm_then_resume_equals_the_uninterrupted_run(tmp_path, start_flowrl):
    # the uninterrupted run `flowrl run grpo RUN --out tmp_path --name ref`, in this process
    overrides = [f"steps={STEPS}", "save_every=1", "rollout.prompts_per_step=4", f"out={tmp_path}", "name=ref"]
    api.run(*api.plan("grpo", overrides=overrides, emit=lambda s: None))
    folder = tmp_path / "run"
    rng = random.Random(0)
    plan = [("kill", "checkpoint"), ("int", "step"), ("kill", "random"), ("term", "step"), ("kill", "checkpoint")]
    during_checkpoint, graceful = 0, 0
    for i, (how, when) in enumerate(plan):
        args = ("grpo", *RUN, "--out", str(tmp_path), "--name", "run") if i == 0 else ("--resume", str(folder))
        proc = start_flowrl(*args)
        seen = len(_complete(folder)) if folder.exists() else 0
        if when == "checkpoint":
            caught = _wait_for(proc, lambda: any((folder / "checkpoints").glob(".tmp-step-*")))
            during_checkpoint += caught
        elif when == "step":
            caught = _wait_for(proc, lambda: len(_lines(folder)) > seen + 2)
        else:
            time.sleep(rng.uniform(0.5, 6.0))
            caught = proc.poll() is None
        if caught:
            proc.send_signal({"kill": signal.SIGKILL, "int": signal.SIGINT, "term": signal.SIGTERM}[how])
        out, err = proc.communicate(timeout=600)
        assert "Traceback" not in err, err
        last = _consistent(folder)
        if caught and how != "kill" and len(_complete(folder)) < STEPS:
            # stopped after the current step, with a checkpoint, saying how to go on (a signal during
            # the last step lets the run finish: exit 0)
            graceful += 1
            assert proc.returncode == 130, err
            assert f"continue with: flowrl run --resume {folder}" in out, out
            assert last == len(_complete(folder)) - 1  # the checkpoint is of the last step logged
        if proc.returncode == 0:  # it finished before (or while) the signal came
            break
    assert during_checkpoint >= 1 and graceful >= 1
    final = start_flowrl("--resume", str(folder))
    out, err = final.communicate(timeout=600)
    assert final.returncode == 0, err
    assert "Traceback" not in err
    a, b = _stripped(tmp_path / "ref"), _stripped(folder)
    assert [r["step"] for r in b] == list(range(STEPS))  # every step once: nothing lost, nothing twice
    assert b[-1]["prompts_drawn"] == a[-1]["prompts_drawn"]  # the prompt stream's cursor
    assert a == b
    assert not list((folder / "checkpoints").glob(".tmp-*"))
