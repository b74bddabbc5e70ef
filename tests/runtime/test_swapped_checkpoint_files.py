"""A checkpoint's files belong to it: each safetensors file is stamped with what it holds (driver: the
step; a model's weights and optimizer state: the model's name and weight version, as its engine.json),
and state.json records every model's version. A file or model folder copied in from another step's
checkpoint is refused naming it, and `flowrl run --resume` falls back to the checkpoint before (as for
a damaged one) instead of continuing silently from the wrong weights; with none left it exits 2.
A checkpoint written before the stamps (no metadata, no versions in state.json) is still resumed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import SMALL_RUN, run_cli

from flowrl.runtime.checkpoint import read_stamp

SETS = [a for s in SMALL_RUN for a in ("--set", s)]
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
OLD, NEW = "step-000000", "step-000001"


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A two-step grpo run keeping both checkpoints (after step 0 and step 1)."""
    out = tmp_path_factory.mktemp("runs")
    from flowrl.cli import main

    argv = ["run", "grpo", "--steps", "2", "--save-every", "1", "--quiet", "--out", str(out), *SETS]
    assert main([*argv, "--set", "keep_checkpoints=2"]) == 0
    return out / "grpo"


@pytest.fixture
def run(finished, tmp_path) -> Path:
    return Path(shutil.copytree(finished, tmp_path / "grpo", symlinks=True))


def _ckpt(run: Path, step: str) -> Path:
    return run / "checkpoints" / step


def test_a_checkpoint_stamps_each_file_with_its_step_model_and_version(finished):
    new = _ckpt(finished, NEW)
    assert read_stamp(new / "driver.safetensors") == {"flowrl.step": "1"}
    version = json.loads((new / "models" / "actor" / "engine.json").read_text())["version"]
    want = {"flowrl.model": "actor", "flowrl.version": str(version)}
    assert read_stamp(new / "models" / "actor" / "model.safetensors") == want
    assert read_stamp(new / "models" / "actor" / "optimizer.safetensors") == want
    assert json.loads((new / "state.json").read_text())["versions"] == {"actor": version}


SWAPS = {
    "the weights": ("models/actor/model.safetensors", "models/actor/model.safetensors"),
    "the optimizer state": ("models/actor/optimizer.safetensors", "models/actor/optimizer.safetensors"),
    "the driver tensors": ("driver.safetensors", "driver.safetensors"),
    "the whole model folder": ("models/actor", "models/actor/engine.json"),
}


def _swap(run: Path, rel: str) -> None:
    a, b = _ckpt(run, OLD) / rel, _ckpt(run, NEW) / rel
    tmp = a.with_name(a.name + ".swap")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)


@pytest.mark.parametrize("what", list(SWAPS))
def test_files_swapped_between_two_checkpoints_are_refused_naming_the_file(what, run, capsys):
    rel, named = SWAPS[what]
    _swap(run, rel)
    code, _, err = run_cli(capsys, "run", "--resume", str(run))
    assert "Traceback" not in err
    assert code == 2, err
    assert str(_ckpt(run, NEW) / named) in err and "another checkpoint" in err, err


@pytest.mark.parametrize("what", list(SWAPS))
@pytest.mark.slow
def test_a_file_copied_in_from_the_older_checkpoint_falls_back_to_it(what, run, capsys):
    rel, named = SWAPS[what]
    dst = _ckpt(run, NEW) / rel
    if dst.is_dir():
        shutil.rmtree(dst)
        shutil.copytree(_ckpt(run, OLD) / rel, dst)
    else:
        shutil.copyfile(_ckpt(run, OLD) / rel, dst)
    code, _, err = run_cli(capsys, "run", "--resume", str(run), "--steps", "3")
    assert code == 0, err
    assert "skipping a newer checkpoint" in err and str(dst if dst.is_file() else _ckpt(run, NEW) / named) in err
    assert f"resuming from the older checkpoint {_ckpt(run, OLD)}" in err
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2], steps


def _unstamp(file: Path) -> None:
    from safetensors.torch import load_file, save_file

    save_file(load_file(str(file)), str(file), metadata={"format": "pt"})


def test_a_checkpoint_written_before_the_stamps_is_resumed(run, capsys):
    new = _ckpt(run, NEW)
    for file in new.rglob("*.safetensors"):
        _unstamp(file)
    state = json.loads((new / "state.json").read_text())
    del state["versions"]
    (new / "state.json").write_text(json.dumps(state))
    code, _, err = run_cli(capsys, "run", "--resume", str(run), "--steps", "3")
    assert code == 0, err
    assert "skipping" not in err
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2], steps
