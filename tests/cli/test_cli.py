"""The flowrl command: every bad input gives one clear paragraph and exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flowrl.cli import main

REPO = Path(__file__).resolve().parents[2]
TINY = ["--set", "rollout.prompts_per_step=2", "--set", "rollout.samples_per_prompt=2", "--set", "checkpoint=false"]


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def graph_file(tmp_path: Path, body: str) -> str:
    path = tmp_path / "bad_graph.py"
    path.write_text(
        "from flowrl.graph import Graph\n\ndef build(cfg):\n" + textwrap.indent(textwrap.dedent(body), "    ")
    )
    return str(path)


BAD_GRAPHS = {
    "cycle": (
        """
        g = Graph("cyc")
        g.model("actor")
        g.generate("rollout", model="actor", writes="responses")
        g.compute("a", fn="grpo", reads="responses b", writes="a")
        g.compute("b", fn="grpo", reads="a", writes="b")
        g.train("t", model="actor", loss="ppo", reads="responses a")
        return g
        """,
        ["cycle", "'a'", "'b'"],
    ),
    "unproduced key": (
        """
        g = Graph("missing")
        g.model("actor")
        g.generate("rollout", model="actor", writes="responses")
        g.train("t", model="actor", loss="ppo", reads="responses advantages")
        return g
        """,
        ["node 't'", "'advantages'", "no node writes"],
    ),
    "two producers": (
        """
        g = Graph("twice")
        g.model("actor")
        g.generate("rollout", model="actor", writes="responses")
        g.reward("r1", fn="task", writes="rewards")
        g.reward("r2", fn="task", writes="rewards")
        g.train("t", model="actor", loss="ppo", reads="responses rewards")
        return g
        """,
        ["'rewards'", "two producers", "'r1'", "'r2'"],
    ),
    "train a frozen model": (
        """
        g = Graph("frozen")
        g.model("actor")
        g.model("ref", "reference", init_from="actor")
        g.generate("rollout", model="actor", writes="responses")
        g.train("t", model="actor", loss="ppo", reads="responses")
        g.train("t_ref", model="ref", loss="ppo", reads="responses")
        return g
        """,
        ["node 't_ref'", "'ref'", "frozen"],
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_GRAPHS))
def test_graph_that_fails_verify(capsys, tmp_path, case):
    body, needles = BAD_GRAPHS[case]
    code, out, err = run_cli(capsys, "run", graph_file(tmp_path, body), "--steps", "1")
    assert code == 2
    assert "Traceback" not in err and err.startswith("flowrl: error: ")
    for needle in needles:
        assert needle in err, (needle, err)


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["run", "graphs/nope.py"], ["graph file 'graphs/nope.py' does not exist"]),
        (["run", "nope_algorithm"], ["unknown algorithm 'nope_algorithm'", "grpo"]),
        (["run", "grpo", "--set", "train.lrr=1"], ["train.lrr"]),
        (["run", "grpo", "--set", "rollout.prompts_per_step=many"], ["rollout.prompts_per_step", "int"]),
        (["run", "grpo", "--set", "rollout.top_p=0"], ["rollout.top_p"]),
        (["run", "grpo", "--model", "/no/such/model"], ["model directory '/no/such/model' does not exist"]),
        (["run", "grpo", "--task", "sing"], ["unknown task 'sing'"]),
        (["run", "grpo", "--config", "/no/such.yaml"], ["config file '/no/such.yaml' does not exist"]),
        (["run", "--plan", "/no/such/plan.yaml"], ["/no/such/plan.yaml"]),
        (["plan", "grpo", "--print-after", "nosuchpass"], ["nosuchpass"]),
        (["run"], ["name a graph"]),
    ],
)
def test_bad_inputs_exit_2_with_one_paragraph(capsys, argv, needles):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2, err
    assert err.startswith("flowrl: error: ") and "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)


def test_unknown_field_in_config_file_names_its_path(capsys, tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("rollout:\n  samples_per_prompt: 4\n  temprature: 0.7\n")
    code, _, err = run_cli(capsys, "run", "grpo", "--config", str(cfg))
    assert code == 2 and "rollout.temprature" in err
    cfg.write_text("train: [1, 2\n")
    code, _, err = run_cli(capsys, "plan", "grpo", "--config", str(cfg))
    assert code == 2 and "not valid YAML" in " ".join(err.split())


def test_show_ppo_has_parallel_reference_and_critic(capsys, tmp_path):
    code, out, _ = run_cli(
        capsys, "show", "graphs/ppo.py", "--dot", str(tmp_path / "g.dot"), "--png", str(tmp_path / "g.png")
    )
    assert code == 0
    stage = next(line for line in out.splitlines() if "ref_logprobs" in line and "forward" in line)
    lines = out.splitlines()
    i = lines.index(stage)
    block = [stage]  # the stage's lines: until the next numbered stage
    for line in lines[i + 1 :]:
        if line.strip()[:2].rstrip(".").isdigit() or not line.startswith("        "):
            break
        block.append(line)
    assert any(" values " in line for line in block + lines[i - 3 : i]), out
    edges = [line.strip() for line in lines if "->" in line and ":" in line]
    assert not any(e.startswith("ref_logprobs -> values") or e.startswith("values -> ref_logprobs") for e in edges)
    assert (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"
    assert "ref_logprobs" in (tmp_path / "g.dot").read_text()


def test_plan_to_file_then_run_the_plan(capsys, tmp_path):
    plan_path = tmp_path / "plan.yaml"
    code, out, err = run_cli(
        capsys, "plan", "grpo", "--steps", "2", "--set", f"out={tmp_path / 'runs'}", *TINY, "--out", str(plan_path)
    )
    assert code == 0, err
    assert plan_path.exists()
    code, out, err = run_cli(capsys, "run", "--plan", str(plan_path), "--quiet")
    assert code == 0, err
    metrics = [json.loads(line) for line in (tmp_path / "runs" / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1]
    assert {"reward", "kl", "tokens_per_s", "spans"} <= set(metrics[0])


def test_print_after_shows_the_plan_between_passes(capsys):
    code, out, _ = run_cli(capsys, "plan", "grpo", "--print-after", "place", *TINY)
    assert code == 0
    assert "plan after pass 'place'" in out
    between = out.split("plan after pass 'place'")[1]
    assert "models:" in between


def test_plugins_lists_builtins(capsys):
    code, out, _ = run_cli(capsys, "plugins")
    assert code == 0
    assert "flowrl.plugins.builtin" in out and "built-in" in out
    for name in ("grpo", "ppo", "gae", "copy", "local"):
        assert f"  {name} " in out


@pytest.mark.slow
def test_python_dash_m_runs_the_cli():
    proc = subprocess.run(
        [sys.executable, "-m", "flowrl", "show", "grpo"], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("graph grpo")
    proc = subprocess.run(
        [sys.executable, "-m", "flowrl", "run", "missing.py"], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
