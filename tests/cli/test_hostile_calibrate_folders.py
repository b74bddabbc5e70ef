"""`flowrl calibrate RUN` reads a run folder as untrusted input: a trace.json or plan.yaml that is garbage,
of another JSON type, nested deeply, a folder, or missing is refused with exit 2 naming the run folder
and the file, never a traceback."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import SMALL_RUN, run_cli

SETS = [a for s in SMALL_RUN for a in ("--set", s)]
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runs")
    from flowrl.cli import main

    assert main(["run", "grpo", "--steps", "1", "--quiet", "--out", str(out), *SETS]) == 0
    return out / "grpo"


def _folder(d: Path, name: str) -> None:
    (d / name).unlink()
    (d / name).mkdir()


CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "trace.json garbage": (lambda d: (d / "trace.json").write_text("{x"), "trace.json"),
    "trace.json a list": (lambda d: (d / "trace.json").write_text("[1, 2]"), "trace.json"),
    "trace.json nested deeply": (lambda d: (d / "trace.json").write_text("[" * 100_000 + "]" * 100_000), "trace.json"),
    "trace.json binary": (lambda d: (d / "trace.json").write_bytes(bytes(range(256)) * 8), "trace.json"),
    "trace.json a folder": (lambda d: _folder(d, "trace.json"), "trace.json"),
    "trace.json missing": (lambda d: (d / "trace.json").unlink(), "trace.json"),
    "plan.yaml garbage": (lambda d: (d / "plan.yaml").write_text("id: [\n"), "plan.yaml"),
    "plan.yaml missing": (lambda d: (d / "plan.yaml").unlink(), ""),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.slow
def test_calibrate_refuses_a_damaged_run_folder_naming_the_file(case, finished, tmp_path, capsys):
    change, needle = CASES[case]
    run = Path(shutil.copytree(finished, tmp_path / "grpo", symlinks=True))
    change(run)
    code, _, err = run_cli(capsys, "calibrate", str(run))
    assert "Traceback" not in err
    assert code == 2, err
    assert str(run) in err and needle in err, err
