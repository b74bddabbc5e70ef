"""No resume loses a run's numbers: a run folder whose metrics.jsonl (and samples.jsonl) a resumed run
would start afresh or cut keeps the earlier file beside it as ``metrics.before-resume-N.jsonl`` (the
first N not taken; an earlier kept file is never overwritten), said in one line on stderr."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import SMALL_RUN, run_cli

SETS = [a for s in SMALL_RUN for a in ("--set", s)]
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A three-step grpo run logging samples, keeping its checkpoints after steps 1 and 2."""
    out = tmp_path_factory.mktemp("runs")
    from flowrl.cli import main

    argv = ["run", "grpo", "--steps", "3", "--save-every", "1", "--quiet", "--out", str(out), *SETS]
    assert main([*argv, "--set", "keep_checkpoints=2", "--set", "log.samples=2", "--set", "log.samples_every=1"]) == 0
    return out / "grpo"


@pytest.fixture
def run(finished, tmp_path) -> Path:
    return Path(shutil.copytree(finished, tmp_path / "grpo", symlinks=True))


def _steps(path: Path) -> list[int]:
    return [r["step"] for r in map(json.loads, path.read_text().splitlines()) if r.get("kind") != "eval"]


@pytest.mark.parametrize("name", ["metrics.jsonl", "samples.jsonl"])
@pytest.mark.slow
def test_a_run_without_checkpoints_that_starts_over_keeps_the_earlier_file(name, run, capsys):
    before = (run / name).read_text()
    assert before
    shutil.rmtree(run / "checkpoints")
    code, _, err = run_cli(capsys, "run", "--resume", str(run), "--steps", "1")
    assert code == 0, err
    stem, suffix = name.split(".")
    aside = run / f"{stem}.before-resume-1.{suffix}"
    assert aside.read_text() == before
    assert f"kept the earlier {name} as {aside.name}" in err
    if name == "metrics.jsonl":
        assert _steps(run / name) == [0]


@pytest.mark.slow
def test_a_kept_file_is_never_overwritten_by_a_later_one(run, capsys):
    mine = run / "metrics.before-resume-1.jsonl"
    mine.write_text("my own notes\n")
    before = (run / "metrics.jsonl").read_text()
    shutil.rmtree(run / "checkpoints")
    code, _, err = run_cli(capsys, "run", "--resume", str(run), "--steps", "1")
    assert code == 0, err
    assert mine.read_text() == "my own notes\n"
    assert (run / "metrics.before-resume-2.jsonl").read_text() == before
    shutil.rmtree(run / "checkpoints")
    code, _, err = run_cli(capsys, "run", "--resume", str(run), "--steps", "1")
    assert code == 0, err
    assert _steps(run / "metrics.before-resume-3.jsonl") == [0]


def test_steps_after_the_checkpoint_are_kept_aside_when_resuming_before_them(run, capsys):
    before = (run / "metrics.jsonl").read_text()
    shutil.rmtree(run / "checkpoints" / "step-000002")
    code, _, err = run_cli(capsys, "run", "--resume", str(run))
    assert code == 0, err
    assert (run / "metrics.before-resume-1.jsonl").read_text() == before
    assert "steps after the checkpoint of step 1: done again" in err
    assert _steps(run / "metrics.jsonl") == [0, 1, 2]


def test_a_resume_from_the_last_checkpoint_keeps_no_copy(run, capsys):
    code, _, err = run_cli(capsys, "run", "--resume", str(run), "--steps", "4")
    assert code == 0, err
    assert not list(run.glob("*.before-resume-*")) and "kept the earlier" not in err
    assert _steps(run / "metrics.jsonl") == [0, 1, 2, 3]


def test_an_api_run_failing_in_a_folder_the_caller_named_leaves_their_files(tmp_path, monkeypatch):
    from flowrl import api
    from flowrl.errors import BackendError
    from flowrl.runtime.executor import PlanExecutor

    def fail(*args, **kwargs):
        raise BackendError("a worker failed during setup")

    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    graph, plan = api.plan("grpo", overrides=SMALL_RUN, flags={"steps": 1}, emit=lambda s: None)
    monkeypatch.setattr(PlanExecutor, "_run", fail)
    with pytest.raises(BackendError):
        api.run(graph, plan, out_dir=folder)
    assert (folder / "notes.txt").read_text() == "keep me"
