"""The README's cluster commands, as a user types them (each `flowrl run` starts and stops its own Ray,
in a subprocess; `flowrl plan` runs in the test's process), and tensor parallelism through the CLI: a
tp2 policy samples in place with no sync; a sparse sync and partial rollouts reach a tp2 replica on a
group of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

pytest.importorskip("ray")

pytestmark = pytest.mark.slow  # each `flowrl` subprocess starts and stops a Ray

SMALL = ["--set", "rollout.prompts_per_step=4", "--set", "rollout.samples_per_prompt=4", "--steps", "2"]


def flowrl(*args: str, cwd=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "FLOWRL_PLUGINS": "ray", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    return subprocess.run(
        [sys.executable, "-m", "flowrl.cli", *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=600
    )


def test_plan_for_cpu2_then_run_the_plan_on_ray(tmp_path, monkeypatch, capsys):
    from flowrl.cli import main

    plan = tmp_path / "plan.yaml"
    runs = tmp_path / "runs"
    monkeypatch.setenv("FLOWRL_PLUGINS", "ray")  # `flowrl plan` in this process (it starts no Ray)
    rc = main(
        ["plan", "graphs/ppo.py", "--cluster", "cpu:2", "--out", str(plan), "--explain", "--set", f"out={runs}", *SMALL]
    )
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "winner:" in out.out and f"run it with `flowrl run graphs/ppo.py --plan {plan}`" in out.out
    assert "executor: ray" in plan.read_text()
    run = flowrl("run", "graphs/ppo.py", "--plan", str(plan), "--quiet")
    assert run.returncode == 0, run.stderr
    folder = next(runs.iterdir())
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1]
    groups = {g["name"] for g in yaml.safe_load(plan.read_text())["layout"]["groups"]}
    assert {w["group"] for w in json.loads((folder / "workers.json").read_text())} == groups
    assert (folder / "timeline.png").exists() and (folder / "trace.json").exists()


def test_cluster_mistakes_exit_2_naming_the_problem(tmp_path, monkeypatch, capsys):
    from flowrl.cli import main

    monkeypatch.setenv("FLOWRL_PLUGINS", "ray")
    monkeypatch.chdir(tmp_path)  # run folders of the refused runs land here

    def cli(*argv: str) -> tuple[int, str]:
        rc = main(list(argv))
        err = " ".join(capsys.readouterr().err.split())
        assert "Traceback" not in err
        return rc, err

    rc, err = cli("run", "grpo", "--backend", "local", "--cluster", "cpu:2", *SMALL)
    assert rc == 2 and "at most 1 device" in err
    rc, err = cli("plan", "grpo", "--placement", "split")
    assert rc == 2 and "add --cluster" in err
    rc, err = cli("plan", "grpo", "--cluster", "cpu:2", "--placement", "split")
    assert rc == 2 and "placement 'split'" in err and "colocate" in err
    rc, err = cli("run", "grpo", "--backend", "ray", "--cluster", "2x8xH100-80G", *SMALL)
    assert rc == 2 and "16 GPUs" in err
    rc, err = cli("run", "--plan", "nope.yaml", "--address", "auto", "--cluster", "cpu:2")
    assert rc == 2 and "--plan runs a plan exactly as planned" in err


# ------------------------------------------------------------ tensor parallelism through the CLI


def _plan_and_run_grpo(tmp_path, *plan_args: str) -> list[dict]:
    plan = tmp_path / "p.yaml"
    made = flowrl(
        "plan", "graphs/grpo.py", *plan_args, "--steps", "3", "--out", str(plan), "--budget", "2",
        "--set", "rollout.prompts_per_step=4", "--set", "rollout.samples_per_prompt=2",
    )  # fmt: skip
    assert made.returncode == 0, made.stderr[-3000:]
    out = tmp_path / "run"
    ran = flowrl("run", "graphs/grpo.py", "--plan", str(plan), "--out", str(out), "--set", "progress=false")
    assert ran.returncode == 0, (ran.stdout[-2000:], ran.stderr[-3000:])
    return [json.loads(line) for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]


def test_a_tp2_policy_samples_in_place_with_no_sync(tmp_path):
    rows = _plan_and_run_grpo(tmp_path, "--cluster", "cpu:2", "--require", "actor.tp=2", "--require", "generation.tp=2")
    assert len(rows) == 3
    assert not any(k.startswith("sync:") for r in rows for k in r)  # nothing moves: the trainer samples
    assert max(r["logprob_gap"] for r in rows if "logprob_gap" in r) < 1e-4


def test_a_sparse_sync_and_partial_rollouts_reach_a_tp2_replica_of_its_own(tmp_path):
    rows = _plan_and_run_grpo(
        tmp_path, "--cluster", "cpu:3", "--require", "generation.tp=2", "--placement", "disaggregated",
        "--sync", "sparse",
    )  # fmt: skip
    assert {r.get("sync:train_actor/strategy") for r in rows} == {"sparse"}
    assert any(r.get("rollout/carried", 0) > 0 for r in rows)  # partial rows resumed on the tp2 replica
    # the sampler's log-probs are the trainer's: the replica holds the synced weights
    assert max(r["logprob_gap"] for r in rows if "logprob_gap" in r) < 1e-4
