"""Run folders as untrusted input: a damaged or edited checkpoint (state.json, driver.json, engine.json,
optimizer.json, their .safetensors), trackers.json, metrics.jsonl, symbolic links out of the run and
tracker packages that fail never crash `flowrl run --resume` with a traceback: each is refused with one
paragraph naming the file and field (exit 2), or handled without losing the run's data. And a run writes
nothing outside its run folder (trackers' and matplotlib's caches included)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import SMALL_RUN, resume, run_cli

from flowrl.runtime import trackers as trackers_mod

ROOT = Path(__file__).resolve().parents[2]
SETS = [a for s in SMALL_RUN for a in ("--set", s)]
STEP = "step-000000"
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A one-step grpo run with its one checkpoint (after step 0)."""
    out = tmp_path_factory.mktemp("runs")
    from flowrl.cli import main

    assert main(["run", "grpo", "--steps", "1", "--save-every", "0", "--quiet", "--out", str(out), *SETS]) == 0
    return out / "grpo"


@pytest.fixture
def run(finished, tmp_path) -> Path:
    return Path(shutil.copytree(finished, tmp_path / "grpo", symlinks=True))


def edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


# ------------------------------------------------------------------ state.json


def _set(key: str, value: Any):
    return lambda d: d.__setitem__(key, value)


STATE_CASES = {
    "a string step": (_set("step", "0"), "field 'step'"),
    "a negative step": (_set("step", -1), "field 'step'"),
    "a huge step": (_set("step", 10**30), "field 'step'"),
    "a step not the folder's": (_set("step", 5), "not the step of its folder"),
    "a negative data cursor": (_set("data", {"epoch": 0, "index": -3}), "field 'data[...]'"),
    "a missing field": (lambda d: d.pop("models"), "models"),
    "extra garbage": (_set("zz_garbage", [1, 2, 3]), "zz_garbage"),
    "a model name that is a path": (_set("models", ["../../../etc"]), "field 'models'"),
    "a mistyped graph_state": (_set("graph_state", {"beta": "high"}), "field 'graph_state[...]'"),
    "a base folder outside as a string": (_set("base", "/etc"), "field 'base'"),
    "another format": (_set("format", 99), "field 'format'"),
}


@pytest.mark.parametrize("case", list(STATE_CASES))
@pytest.mark.slow
def test_an_edited_state_json_is_refused_naming_the_file_and_field(case, run, capsys):
    change, field = STATE_CASES[case]
    edit_json(run / "checkpoints" / STEP / "state.json", change)
    code, err = resume(capsys, run)
    assert code == 2 and "state.json" in err and field in err, err


@pytest.mark.parametrize(
    "text",
    ["{not json", "[1, 2, 3]", '{"step": ' + "[" * 100_000 + "]" * 100_000 + "}", ""],
    ids=["not-json", "an-array", "nested-too-deep", "empty"],
)
def test_a_state_json_that_is_no_manifest_is_refused_naming_it(text, run, capsys):
    (run / "checkpoints" / STEP / "state.json").write_text(text)
    code, err = resume(capsys, run)
    assert code == 2 and f"{STEP}/state.json" in err, err


def test_a_huge_state_json_is_refused_unread(run, capsys):
    with (run / "checkpoints" / STEP / "state.json").open("ab") as fh:
        fh.truncate(17 << 20)
    code, err = resume(capsys, run)
    assert code == 2 and "state.json" in err and "bytes" in err, err


# ------------------------------------------------------------------ driver.json and the tensors


def _driver_entry(key: str, change):
    """Edit field ``key`` of driver.json's top-level {"$dict": [[k, v], ...]}."""

    def edit(d):
        for pair in d["$dict"]:
            if pair[0] == key:
                pair[1] = change(pair[1])

    return edit


DRIVER_CASES = {
    "a negative prompt cursor": (_driver_entry("prompts_drawn", lambda v: -4), "field 'prompts_drawn'"),
    "a string prompt cursor": (_driver_entry("prompts_drawn", lambda v: "7"), "field 'prompts_drawn'"),
    "a broken prompt RNG": (_driver_entry("prompt_rng", lambda v: [1, 2]), "field 'prompt_rng'"),
    "a version of an unknown model": (
        _driver_entry("generator_versions", lambda v: {"$dict": [["ghost", 1]]}),
        "field 'generator_versions'",
    ),  # fmt: skip
    "a missing field": (lambda d: d["$dict"].pop(), "field 'snapshot'"),
    "an extra field": (lambda d: d["$dict"].append(["zz_extra", 1]), "field 'zz_extra'"),
    "an unknown stored type": (_driver_entry("snapshot", lambda v: {"$type": "Popen", "fields": {}}), "driver.json"),
    "a tensor it does not have": (_driver_entry("torch_rng", lambda v: {"$tensor": "t999"}), "driver.json"),
}


@pytest.mark.parametrize("case", list(DRIVER_CASES))
def test_an_edited_driver_json_is_refused_naming_the_file_and_field(case, run, capsys):
    change, field = DRIVER_CASES[case]
    edit_json(run / "checkpoints" / STEP / "driver.json", change)
    code, err = resume(capsys, run)
    assert code == 2 and "driver.json" in err and field in err, err


@pytest.mark.parametrize(
    "file",
    ["driver.safetensors", "models/actor/model.safetensors", "models/actor/optimizer.safetensors"],
)
@pytest.mark.parametrize("how", ["truncated", "garbage"])
def test_a_damaged_safetensors_file_is_refused_naming_it(file, how, run, capsys):
    path = run / "checkpoints" / STEP / file
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if how == "truncated" else b"\x00garbage" * 64)
    code, err = resume(capsys, run)
    assert code == 2 and f"{Path(file).stem}." in err and ".safetensors" in err and STEP in err, err


@pytest.mark.parametrize(
    "text",
    ['{"version": -1}', '{"version": "1"}', '{"version": 1, "x": 2}', "nope"],
    ids=["negative", "string", "extra", "not-json"],
)
def test_an_edited_engine_json_is_refused_naming_it(text, run, capsys):
    (run / "checkpoints" / STEP / "models" / "actor" / "engine.json").write_text(text)
    code, err = resume(capsys, run)
    assert code == 2 and "engine.json" in err, err


@pytest.mark.slow
def test_an_optimizer_state_of_another_model_is_refused_naming_it(run, capsys):
    edit_json(run / "checkpoints" / STEP / "models" / "actor" / "optimizer.json", lambda d: d["$dict"].clear())
    code, err = resume(capsys, run)
    assert code == 2 and "optimizer.json" in err, err


# ------------------------------------------------------------------ symbolic links


def test_a_checkpoint_that_links_out_of_the_run_is_refused_and_nothing_outside_changes(run, tmp_path, capsys):
    outside = tmp_path / "elsewhere"
    shutil.move(run / "checkpoints" / STEP, outside)
    (run / "checkpoints" / STEP).symlink_to(outside, target_is_directory=True)
    before = sorted(p.name for p in outside.rglob("*"))
    code, err = resume(capsys, run)
    assert code == 2 and "symbolic link" in err and STEP in err, err
    assert sorted(p.name for p in outside.rglob("*")) == before


def test_a_file_in_a_checkpoint_that_links_out_of_the_run_is_refused(run, tmp_path, capsys):
    model = run / "checkpoints" / STEP / "models" / "actor" / "model.safetensors"
    shutil.move(model, tmp_path / "weights.safetensors")
    model.symlink_to(tmp_path / "weights.safetensors")
    code, err = resume(capsys, run)
    assert code == 2 and "symbolic link" in err and "model.safetensors" in err, err


def test_a_run_folder_that_is_a_symlink_resumes_into_its_target(run, tmp_path, capsys):
    link = tmp_path / "link"
    link.symlink_to(run, target_is_directory=True)
    code, err = resume(capsys, link, "--steps", "2")
    assert code == 0, err
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2


# ------------------------------------------------------------------ metrics.jsonl


@pytest.mark.parametrize(
    "line",
    [b"x" * (50 << 20), b"\x00\xff garbage", b'{"step": "zero"}', b'{"step": 0, "reward": "high", "step_seconds": 1}'],
    ids=["a-50MB-line", "garbage", "a-string-step", "a-string-reward"],
)
def test_a_bad_metrics_line_before_the_checkpoint_is_refused_naming_the_line_and_the_file_is_kept(line, run, capsys):
    path = run / "metrics.jsonl"
    path.write_bytes(line + b"\n" + path.read_bytes())
    before = path.read_bytes()
    code, err = resume(capsys, run, "--steps", "2")
    assert code == 2 and "metrics.jsonl" in err and "line 1" in err, err[:2000]
    assert len(err) < 2000  # one paragraph, not the line
    assert path.read_bytes() == before


@pytest.mark.slow
def test_a_half_written_line_after_the_checkpoint_is_dropped_and_the_run_goes_on(run, capsys):
    with (run / "metrics.jsonl").open("a") as fh:
        fh.write('{"step": 1, "rew')
    code, err = resume(capsys, run, "--steps", "2")
    assert code == 0, err
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1]


# ------------------------------------------------------------------ trackers.json and tracker packages


@pytest.mark.parametrize(
    "text, field",
    [
        ("{not json", "unreadable"),
        ('["wandb"]', "list"),
        ('{"wandb": 7}', "field 'wandb'"),
        ('{"wandb": "../../../../tmp/x"}', "field 'wandb'"),
        ('{"wandb": "ab\\u0007cd\\nef"}', "field 'wandb'"),
        ('{"neptune": "abc"}', "field 'neptune'"),
    ],
    ids=["not-json", "a-list", "a-number", "path-separators", "control-characters", "unknown-logger"],
)
def test_a_corrupt_trackers_json_is_refused_on_resume_naming_file_and_field(text, field, run, capsys):
    (run / "trackers.json").write_text(text)
    code, err = resume(capsys, run, "--logger", "tensorboard", "--steps", "2")
    assert code == 2 and "trackers.json" in err and field in err, err
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1


@pytest.mark.parametrize("raise_", ["raise RuntimeError('broken install')", "raise SystemExit(3)"])
def test_a_tracker_package_whose_import_fails_is_named_with_its_logger(raise_, tmp_path, monkeypatch):
    fake = tmp_path / "site" / "wandb"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(raise_ + "\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    with pytest.raises(trackers_mod.ConfigError) as err:
        trackers_mod.open_trackers(["wandb"], tmp_path / "run", "grpo", {}, False)
    text = str(err.value)
    assert "--logger wandb" in text and "'wandb' package" in text and "\n" not in text


@pytest.mark.slow
def test_a_tracker_package_whose_import_fails_exits_2_from_the_cli(tmp_path):
    fake = tmp_path / "site" / "mlflow"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise RuntimeError('half-installed')\n")
    done = subprocess.run(
        [sys.executable, "-m", "flowrl", "run", "grpo", "--steps", "1", "--quiet", "--out", str(tmp_path / "runs"),
         "--logger", "mlflow", *SETS],
        cwd=ROOT, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=240,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--logger mlflow" in done.stderr and "half-installed" in done.stderr and "Traceback" not in done.stderr


class _Failing:
    """A tracker that fails at its second record."""

    id = None

    def __init__(self) -> None:
        self.seen: list[int] = []
        self.closed = False

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.seen:
            raise OSError("disk of the tracker is full")
        self.seen.append(step)

    def close(self) -> None:
        self.closed = True


def test_a_tracker_that_fails_mid_run_is_dropped_with_one_warning_and_the_others_go_on(capsys):
    bad, good = _Failing(), _Failing()
    good.log = lambda metrics, step: good.seen.append(step)  # type: ignore[method-assign]
    group = trackers_mod.Trackers([bad, good])
    for step in range(3):
        group.log({"reward": 1.0}, step)
    group.close()
    err = capsys.readouterr().err
    assert bad.seen == [0] and bad.closed and good.seen == [0, 1, 2] and good.closed
    assert err.count("warning") == 1 and "failed at step 1" in err and "disk of the tracker is full" in err


@pytest.mark.slow
def test_a_tracker_failing_mid_run_loses_no_metrics_or_checkpoints(tmp_path, capsys, monkeypatch):
    real = trackers_mod.TensorBoard.log

    def flaky(self, metrics, step):
        if step >= 1:
            raise RuntimeError("tensorboard went away")
        real(self, metrics, step)

    monkeypatch.setattr(trackers_mod.TensorBoard, "log", flaky)
    code, out, err = run_cli(
        capsys, "run", "grpo", "--steps", "3", "--quiet", "--out", str(tmp_path), "--logger", "tensorboard", *SETS
    )
    assert code == 0, err
    assert "--logger tensorboard failed at step 1" in err and "tensorboard went away" in err
    assert [json.loads(x)["step"] for x in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    assert (tmp_path / "grpo" / "checkpoint" / "model.safetensors").is_file()


# ------------------------------------------------------------------ nothing outside the run folder


def _installed(names: list[str]) -> list[str]:
    import importlib.util

    return [n for n in names if importlib.util.find_spec(trackers_mod.TRACKERS[n].module) is not None]


@pytest.mark.slow
def test_a_run_with_every_installed_tracker_writes_nothing_to_home(tmp_path):
    """HOME an empty folder, XDG_* unset, no library variable set: afterwards HOME is still empty and the
    caches (wandb's, matplotlib's) are in the run folder."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    loggers = _installed(list(trackers_mod.TRACKERS))
    drop = ("XDG_", "WANDB_", "MPLCONFIGDIR", "MLFLOW_", "TRACKIO_", "HF_HOME", "TENSORBOARD")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(HOME=str(home), PYTHONPATH=str(ROOT))
    argv = ["run", "grpo", "--steps", "1", "--quiet", "--out", str(tmp_path / "runs"), *SETS]
    if loggers:
        argv += ["--logger", ",".join(loggers)]
    done = subprocess.run(
        [sys.executable, "-m", "flowrl", *argv], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(str(p.relative_to(home)) for p in home.rglob("*")) == []
    assert sorted(str(p.relative_to(cwd)) for p in cwd.rglob("*")) == []
    assert (tmp_path / "runs" / "grpo" / ".cache" / "matplotlib").is_dir()


def test_a_variable_the_user_set_wins_and_flowrls_own_moves_with_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("MPLCONFIGDIR", str(tmp_path / "mine"))
    assert trackers_mod.default_env("MPLCONFIGDIR", tmp_path / "run" / "mpl") == str(tmp_path / "mine")
    monkeypatch.delenv("WANDB_CACHE_DIR", raising=False)
    first = trackers_mod.default_env("WANDB_CACHE_DIR", tmp_path / "a")
    second = trackers_mod.default_env("WANDB_CACHE_DIR", tmp_path / "b")
    assert (first, second) == (str(tmp_path / "a"), str(tmp_path / "b"))
