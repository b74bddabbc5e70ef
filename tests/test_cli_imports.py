"""What a CLI call imports: help, error exits, `flowrl plugins` and a plan for a named cluster load
every plugin's registrations (`--help` only the CLI commands) but none of torch, transformers,
vLLM or Ray, which load only when something runs. Each case runs in a fresh interpreter with the
installed plugins; the test asserts on ``sys.modules`` afterwards, not on time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("torch", "transformers", "vllm", "ray")

PROBE = f"""
import json, sys
from flowrl.cli import main
out, argv = sys.argv[1], sys.argv[2:]
try:
    code = main(argv)
except SystemExit as exc:  # argparse's --help
    code = exc.code
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r})
with open(out, "w") as fh:
    json.dump({{"code": code, "heavy": heavy}}, fh)
"""


def cli(tmp_path: Path, *argv: str) -> tuple[int, list[str], str]:
    """Run ``flowrl ARGV`` in a fresh interpreter: its exit code, the heavy modules it imported, its stderr."""
    out = tmp_path / "probe.json"
    env = {k: v for k, v in os.environ.items() if k != "FLOWRL_PLUGINS"}  # every installed plugin loads
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(out), *argv],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0 and out.is_file(), proc.stderr
    result = json.loads(out.read_text())
    return result["code"], result["heavy"], proc.stderr


CLUSTER = ["plan", "grpo", "--cluster", "8xH100-80G", "--model", "llama-7b"]


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["plan", "--help"], ["run", "--help"], ["plugins"]],
    ids=["help", "plan-help", "run-help", "plugins"],
)
def test_help_and_plugins_load_no_torch(tmp_path, argv):
    code, heavy, err = cli(tmp_path, *argv)
    assert code == 0, err
    assert heavy == [], heavy


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan", "grpo", "--cluster", "8xH100-80G", "--model", "nosuchmodel"], "model 'nosuchmodel'"),
        (["plan", "grpo", "--cluster", "0xH100-80G", "--model", "llama-7b"], "device count must be >= 1"),
        (["plan", "nosuchgraph"], "unknown algorithm 'nosuchgraph'"),
        ([*CLUSTER, "--seed", "-5"], "'seed'"),
        ([*CLUSTER, "--budget", "-1"], "--budget"),
        ([*CLUSTER, "--require", "nosuch=1"], "unknown key 'nosuch'"),
        (["run", "grpo", "--set", "train.lr=abc"], "train.lr"),
    ],
    ids=["model", "cluster", "graph", "seed", "budget", "require", "config-value"],
)
def test_error_exits_load_no_torch(tmp_path, argv, message):
    code, heavy, err = cli(tmp_path, *argv)
    assert code == 2, err
    assert err.startswith("flowrl: error: ") and message in " ".join(err.split()), err
    assert "Traceback" not in err
    assert heavy == [], heavy


@pytest.mark.slow
def test_a_plan_for_a_named_cluster_loads_no_torch(tmp_path):
    code, heavy, err = cli(tmp_path, *CLUSTER, "--budget", "1", "--out", "plan.yaml")
    assert code == 0, err
    assert (tmp_path / "plan.yaml").is_file()
    assert heavy == [], heavy


def test_builtin_functions_register_without_torch_and_keep_resolvable_annotations():
    """The planner checks a node's options against the annotations of the function it calls
    (typing.get_type_hints); registering the built-ins without torch must keep them resolvable."""
    code = (
        "import sys, typing\n"
        "from flowrl.plugins.manager import load_plugins\n"
        "_, reg = load_plugins(entry_points=False)\n"
        "kinds = ('compute_functions', 'losses', 'reward_functions', 'filters', 'environments')\n"
        "entries = [e for k in kinds for e in reg.entries(k)]\n"
        "assert entries\n"
        "for e in entries:\n"
        "    typing.get_type_hints(e.obj)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
