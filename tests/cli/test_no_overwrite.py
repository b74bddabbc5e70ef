"""Nothing outside what the user asked for: no command replaces a file it did not create unless
--force; a plan (or a run folder) naming a graph file runs it only when the command line names
that file too; --resume refuses what it cannot continue, naming the folder."""

from __future__ import annotations

from pathlib import Path

from flowrl.cli import main


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out, " ".join(cap.err.split())


def test_plan_and_show_outputs_are_not_replaced_without_force(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    plan.write_text("mine\n")
    rc, _, err = _run(capsys, "plan", "grpo", "--out", str(plan))
    assert rc == 2 and "already there" in err and "--force" in err and plan.read_text() == "mine\n", err
    rc, _, err = _run(capsys, "plan", "grpo", "--out", str(plan), "--force")
    assert rc == 0 and plan.read_text() != "mine\n"
    dot = tmp_path / "g.dot"
    dot.write_text("mine")
    rc, _, err = _run(capsys, "show", "grpo", "--dot", str(dot))
    assert rc == 2 and "--dot" in err and dot.read_text() == "mine", err
    rc, _, _ = _run(capsys, "show", "grpo", "--dot", str(dot), "--force")
    assert rc == 0 and dot.read_text().startswith("digraph")


def test_plan_never_writes_over_its_own_config(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("steps: 3\n")
    for extra in ([], ["--force"]):
        rc, _, err = _run(capsys, "plan", "grpo", "--config", str(config), "--out", str(config), *extra)
        assert rc == 2 and "is the --config file" in err and config.read_text() == "steps: 3\n", err


def test_a_plan_runs_a_graph_file_only_when_the_command_line_names_it(tmp_path, capsys):
    graph = tmp_path / "mine.py"
    graph.write_text(Path("graphs/grpo.py").read_text())
    plan = tmp_path / "p.yaml"
    rc, _, err = _run(capsys, "plan", str(graph), "--out", str(plan))
    assert rc == 0, err
    rc, _, err = _run(capsys, "run", "--plan", str(plan))
    assert rc == 2 and f"would run the graph file '{graph}'" in err and f"flowrl run {graph} --plan" in err, err
    other = tmp_path / "other.py"
    other.write_text(Path("graphs/ppo.py").read_text())
    rc, _, err = _run(capsys, "run", str(other), "--plan", str(plan))
    assert rc == 2 and "the plan was made for graph 'grpo'" in err and "builds 'ppo'" in err, err


def test_resume_names_what_it_cannot_continue(tmp_path, capsys):
    rc, _, err = _run(capsys, "run", "--resume", str(tmp_path / "nope"))
    assert rc == 2 and "does not exist" in err and "nope" in err, err
    rc, _, err = _run(capsys, "run", "--resume", str(tmp_path))
    assert rc == 2 and "not a run folder" in err, err
    rc, _, err = _run(capsys, "run", "--resume", str(tmp_path), "--set", "train.lr=1")
    assert rc == 2 and "only --steps" in err, err
    (tmp_path / "plan.yaml").write_text("{{{ not yaml")
    rc, _, err = _run(capsys, "run", "--resume", str(tmp_path))
    assert rc == 2 and "plan.yaml" in err and "Traceback" not in err, err


def test_save_every_must_be_a_count(capsys):
    rc, _, err = _run(capsys, "plan", "grpo", "--set", "save_every=-1")
    assert rc == 2 and "save_every" in err, err
    rc, _, err = _run(capsys, "plan", "grpo", "--set", "keep_checkpoints=0")
    assert rc == 2 and "keep_checkpoints" in err, err
