"""Tensor parallelism end to end through the CLI on Ray (issue 24's review): a tp2 policy samples in
place with no sync; a sparse sync and partial rollouts reach a tp2 replica on a group of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SMALL = ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=2", "progress=false", "checkpoint=false"]


# ------------------------------------------------------------ Ray, end to end (the CLI)


def _flowrl(*args: str, cwd: Path = REPO, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("FLOWRL_PLUGINS", None)  # the CLI runs Ray through its entry point
    return subprocess.run(
        [sys.executable, "-m", "flowrl.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def _plan_and_run(tmp_path: Path, *plan_args: str) -> list[dict]:
    plan = tmp_path / "p.yaml"
    made = _flowrl(
        "plan", "graphs/grpo.py", *plan_args, "--steps", "3", "--out", str(plan), "--budget", "2",
        "--set", "rollout.prompts_per_step=4", "--set", "rollout.samples_per_prompt=2",
    )  # fmt: skip
    assert made.returncode == 0, made.stderr[-3000:]
    out = tmp_path / "run"
    ran = _flowrl("run", "graphs/grpo.py", "--plan", str(plan), "--out", str(out), "--set", "progress=false")
    assert ran.returncode == 0, (ran.stdout[-2000:], ran.stderr[-3000:])
    return [json.loads(line) for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_ray_a_tp2_policy_samples_in_place_with_no_sync(tmp_path):
    rows = _plan_and_run(tmp_path, "--cluster", "cpu:2", "--require", "actor.tp=2", "--require", "generation.tp=2")
    assert len(rows) == 3
    assert not any(k.startswith("sync:") for r in rows for k in r)  # nothing moves: the trainer samples
    assert max(r["logprob_gap"] for r in rows if "logprob_gap" in r) < 1e-4


@pytest.mark.slow
def test_ray_a_sparse_sync_and_partial_rollouts_reach_a_tp2_replica_of_its_own(tmp_path):
    rows = _plan_and_run(
        tmp_path, "--cluster", "cpu:3", "--require", "generation.tp=2", "--placement", "disaggregated",
        "--sync", "sparse",
    )  # fmt: skip
    assert {r.get("sync:train_actor/strategy") for r in rows} == {"sparse"}
    assert any(r.get("rollout/carried", 0) > 0 for r in rows)  # partial rows resumed on the tp2 replica
    # the sampler's log-probs are the trainer's: the replica holds the synced weights
    assert max(r["logprob_gap"] for r in rows if "logprob_gap" in r) < 1e-4
