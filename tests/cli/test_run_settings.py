"""Where a run goes and how it checkpoints are not plan content: `--out`, `--name`, `--save-every`,
`--set keep_checkpoints=` and `--set progress=` go with `--plan` (and all but the folder with
`--resume`) without changing the plan's id; plan files an earlier flowrl wrote (`backend:`) load."""

from __future__ import annotations

import shutil
from pathlib import Path

import msgspec
import pytest
from helpers import SMALL_RUN, run_cli

from flowrl import api
from flowrl.contract.plan import ExecutionPlan, dump_plan, load_plan
from flowrl.errors import ConfigError

DATA = Path(__file__).parent / "data"
#: written by flowrl before `backend` became `executor` (v1: the commit before the rename; v0: before
#: plans held resolved node options and model specs): grpo, 2 steps, save_every 1
LEGACY = DATA / "plan_v1_backend.yaml"
LEGACY_V0 = DATA / "plan_v0_backend.yaml"
SMALL = SMALL_RUN


@pytest.fixture(scope="module")
def plan() -> ExecutionPlan:
    return api.plan("grpo", overrides=SMALL, flags={"steps": 3}, emit=lambda s: None)[1]


# ---------------------------------------------------------------------------- the plan's id


def test_run_settings_do_not_change_the_plan_id_and_the_plan_records_them(plan: ExecutionPlan) -> None:
    moved = plan.with_run_settings(
        {"out": "elsewhere", "name": "mine", "save_every": 1, "keep_checkpoints": 5, "progress": False}
    )
    assert moved.id == plan.id == plan.content_id()
    assert (moved.config.out, moved.config.name, moved.config.save_every, moved.config.keep_checkpoints) == (
        "elsewhere",
        "mine",
        1,
        5,
    )
    for change in ({"seed": 1}, {"steps": 4}, {"executor": "other"}, {"nodes": {"advantages": {"eps": 0.1}}}):
        config = msgspec.structs.replace(plan.config, **change)
        assert msgspec.structs.replace(plan, config=config).content_id() != plan.id, change


def test_only_run_settings_may_change_and_they_are_checked(plan: ExecutionPlan) -> None:
    with pytest.raises(ConfigError, match="seed: not run settings"):
        plan.with_run_settings({"seed": 1})
    with pytest.raises(ConfigError, match="keep_checkpoints' must be >= 1"):
        plan.with_run_settings({"keep_checkpoints": 0})


def test_a_plan_file_edited_only_in_its_run_settings_is_not_edited(plan: ExecutionPlan, tmp_path: Path) -> None:
    path = dump_plan(plan, tmp_path / "plan.yaml")
    text = path.read_text()
    path.write_text(text.replace("  out: runs\n", "  out: elsewhere\n"))
    assert load_plan(path).id == plan.id and load_plan(path).config.out == "elsewhere"
    path.write_text(text.replace("  seed: 0\n", "  seed: 1\n"))
    with pytest.raises(ConfigError, match="edited after it was planned"):
        load_plan(path)


# ---------------------------------------------------------------------------- plans an earlier flowrl wrote


@pytest.mark.parametrize("path", [LEGACY, LEGACY_V0], ids=["v1", "v0"])
def test_a_plan_file_written_before_the_rename_loads_unedited(path: Path) -> None:
    assert "  backend: local\n" in path.read_text()
    plan = load_plan(path)
    assert plan.config.executor == "local"
    assert plan.id == plan.content_id()  # sealed again, with today's content id


def test_an_edited_old_plan_file_is_still_refused(tmp_path: Path) -> None:
    path = tmp_path / "plan.yaml"
    path.write_text(LEGACY.read_text().replace("  seed: 0\n", "  seed: 1\n"))
    with pytest.raises(ConfigError, match="edited after it was planned"):
        load_plan(path)


def test_a_plan_file_giving_both_names_differently_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "plan.yaml"
    path.write_text(LEGACY.read_text().replace("  backend: local\n", "  backend: local\n  executor: ray\n"))
    with pytest.raises(ConfigError, match=r"plan file '.*plan.yaml': the config gives both executor='ray'"):
        load_plan(path)


@pytest.mark.slow
def test_an_old_plan_runs_and_an_old_run_folder_resumes(capsys, tmp_path: Path) -> None:
    code, out, err = run_cli(capsys, "run", "--plan", str(LEGACY), "--out", str(tmp_path), "--quiet")
    assert code == 0, err
    folder = tmp_path / "grpo"
    assert "executor: local" in (folder / "plan.yaml").read_text()
    shutil.copy(LEGACY, folder / "plan.yaml")  # the folder as the earlier flowrl left it
    code, out, err = run_cli(capsys, "run", "--resume", str(folder), "--steps", "3", "--quiet")
    assert code == 0, err
    assert "continued at step 2" in out
    assert "executor: local" in (folder / "plan.yaml").read_text()


# ---------------------------------------------------------------------------- the command line


@pytest.mark.slow
def test_plan_runs_where_out_says_with_its_checkpoint_settings_and_the_same_id(
    capsys, plan: ExecutionPlan, tmp_path: Path
) -> None:
    path = dump_plan(plan, tmp_path / "plan.yaml")
    argv = ["run", "--plan", str(path), "--out", str(tmp_path / "runs"), "--save-every", "1", "--quiet"]
    argv += ["--set", "keep_checkpoints=3", "--set", "name=mine", "--set", "progress=false"]
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert f"plan {plan.id}" in out
    folder = tmp_path / "runs" / "mine"
    ran = load_plan(folder / "plan.yaml")
    assert ran.id == plan.id
    assert (ran.config.out, ran.config.name, ran.config.save_every, ran.config.keep_checkpoints) == (
        str(tmp_path / "runs"),
        "mine",
        1,
        3,
    )
    assert sorted(p.name for p in (folder / "checkpoints").iterdir()) == ["step-000000", "step-000001", "step-000002"]
    # resume keeps its folder; its checkpoint settings may change, and its plan.yaml records them
    code, out, err = run_cli(
        capsys, "run", "--resume", str(folder), "--steps", "4", "--set", "keep_checkpoints=1", "--quiet"
    )
    assert code == 0, err
    assert [p.name for p in (folder / "checkpoints").iterdir()] == ["step-000003"]
    assert load_plan(folder / "plan.yaml").config.keep_checkpoints == 1


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--seed", "3"], ["--seed"]),
        (["--set", "train.lr=1"], ["train.lr"]),
        (["--set", "backend=ray"], ["executor"]),
        (["--steps", "9", "--set", "algo.kl_coef=0"], ["--steps", "algo.kl_coef"]),
        (["--cluster", "cpu:2"], ["--cluster"]),
    ],
)
def test_plan_refuses_what_would_change_the_plan_naming_it(
    capsys, plan: ExecutionPlan, tmp_path: Path, extra: list[str], named: list[str]
) -> None:
    path = dump_plan(plan, tmp_path / "plan.yaml")
    code, _, err = run_cli(capsys, "run", "--plan", str(path), "--out", str(tmp_path), *extra)
    assert code == 2 and "Traceback" not in err
    assert "--plan runs a plan exactly as planned" in err and "`flowrl plan`" in err, err
    assert all(n in err for n in named), err
    assert "only where the run goes and how it checkpoints and reports may change: --out DIR, --name NAME" in err
    assert "--save-every N" in err and "--logger NAMES" in err
    assert not (tmp_path / "grpo").exists()


def test_plan_takes_run_settings_from_a_config_file_and_refuses_the_rest(
    capsys, plan: ExecutionPlan, tmp_path: Path
) -> None:
    path = dump_plan(plan, tmp_path / "plan.yaml")
    config = tmp_path / "run.yaml"
    config.write_text("train:\n  lr: 0.5\nsave_every: 2\n")
    code, _, err = run_cli(capsys, "run", "--plan", str(path), "--config", str(config))
    assert code == 2 and "train.lr would change what was planned" in err, err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--out", "x"], "--out chooses where a new run goes: drop it"),
        (["--name", "x", "--set", "out=y"], "out and --name choose where a new run goes: drop them"),
        (["--seed", "3"], "--resume runs a plan exactly as planned; --seed would change what was planned"),
        (["--plan", "p.yaml"], "drop --plan"),
    ],
)
def test_resume_keeps_its_folder_and_its_plan(capsys, tmp_path: Path, extra: list[str], message: str) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    shutil.copy(LEGACY, folder / "plan.yaml")
    code, _, err = run_cli(capsys, "run", "--resume", str(folder), *extra)
    assert code == 2 and message in err, err
    if "--plan" not in extra:
        assert (
            "only --steps N (to extend it) and how the run checkpoints and reports may change: --save-every N" in err
        ), err
