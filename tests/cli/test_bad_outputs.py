"""Outputs that cannot be written, and graph files that end the process, are one clear error (exit 2)."""

from __future__ import annotations

from flowrl.cli import main


def _run(capsys, *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    return rc, " ".join(capsys.readouterr().err.split())


def test_outputs_under_a_file_are_named(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    rc, err = _run(capsys, "plan", "grpo", "--out", str(blocker / "plan.yaml"))
    assert rc == 2 and "is a file, so nothing can be written under it" in err and "Traceback" not in err, err
    rc, err = _run(capsys, "show", "grpo", "--dot", str(blocker / "g.dot"))
    assert rc == 2 and "nothing can be written under it" in err and "g.dot" in err, err
    rc, err = _run(capsys, "run", "grpo", "--steps", "1", "--out", str(blocker), "--set", "progress=false")
    assert rc == 2 and "cannot create the run folder" in err, err


def test_a_graph_file_that_exits_on_import_is_named(tmp_path, capsys):
    graph = tmp_path / "exits.py"
    graph.write_text("import sys\nsys.exit(7)\n")
    rc, err = _run(capsys, "show", str(graph))
    assert rc == 2 and "sys.exit(7)" in err and str(graph) in err, err
