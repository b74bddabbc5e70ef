"""Run folders and plan files as untrusted input, past what test_hostile_run_files.py covers: a run
folder whose own entries are of another kind (a folder named samples.jsonl, a file named checkpoints),
an edited plan.yaml in it, a folder that is no run, checkpoints swapped or half-written, and a plan
file given with ``--plan`` that is garbage, nested too deep, a YAML bomb, from another graph or with a
layout out of range (10^9 devices, a negative device index, a staleness of 10^9). Each is exit 2 with
one paragraph naming the file, field or entry, never a traceback or a hang, and nothing the user had
is changed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import SMALL_RUN, resume, run_cli

SETS = [a for s in SMALL_RUN for a in ("--set", s)]
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A two-step grpo run with a checkpoint after each step."""
    out = tmp_path_factory.mktemp("runs")
    from flowrl.cli import main

    assert main(["run", "grpo", "--steps", "2", "--save-every", "1", "--quiet", "--out", str(out), *SETS]) == 0
    return out / "grpo"


@pytest.fixture
def run(finished, tmp_path) -> Path:
    return Path(shutil.copytree(finished, tmp_path / "grpo", symlinks=True))


def _replace(path: Path, kind: str) -> None:
    """``path`` made a folder holding one user file, or a file."""
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
    if kind == "folder":
        path.mkdir()
        (path / "mine.txt").write_text("the user's")
    else:
        path.write_text("the user's")


# ------------------------------------------------------------------ the run folder's own entries


@pytest.mark.parametrize(
    "name, kind",
    [
        ("samples.jsonl", "folder"),
        ("trace.json", "folder"),
        ("timeline.png", "folder"),
        ("reward.png", "folder"),
        (".lock", "folder"),
        ("checkpoints", "file"),
        (".cache", "file"),
    ],
)
@pytest.mark.slow
def test_a_run_folder_entry_of_another_kind_is_refused_before_the_run_and_kept(name, kind, run, capsys):
    _replace(run / name, kind)
    metrics = (run / "metrics.jsonl").read_bytes()
    code, err = resume(capsys, run, "--steps", "3")
    assert code == 2 and f"'{name}' is a {kind}" in err and str(run) in err, err
    assert (run / name / "mine.txt").read_text() if kind == "folder" else (run / name).read_text() == "the user's"
    assert (run / "metrics.jsonl").read_bytes() == metrics


def test_a_run_folder_entry_linked_to_nothing_is_refused_naming_it(run, capsys):
    (run / "trace.json").unlink()
    (run / "trace.json").symlink_to(run / "nowhere")
    code, err = resume(capsys, run, "--steps", "3")
    assert code == 2 and "'trace.json' is neither a file nor a folder" in err, err


def test_a_new_run_beside_a_folder_holding_a_checkpoints_file_leaves_it_alone(tmp_path, capsys):
    (tmp_path / "grpo").mkdir()
    (tmp_path / "grpo" / "checkpoints").write_text("x")
    code, out, err = run_cli(capsys, "run", "grpo", "--steps", "1", "--quiet", "--out", str(tmp_path), *SETS)
    assert code == 0 and "Traceback" not in err, err
    assert (tmp_path / "grpo" / "checkpoints").read_text() == "x"
    assert sorted(p.name for p in (tmp_path / "grpo").iterdir()) == ["checkpoints"]


# ------------------------------------------------------------------ plan.yaml of the run folder


def _edit_plan(change) -> Any:
    def edit(run: Path) -> None:
        data = yaml.safe_load((run / "plan.yaml").read_text())
        change(data)
        (run / "plan.yaml").write_text(yaml.safe_dump(data))

    return edit


def _write(text: str):
    return lambda run: (run / "plan.yaml").write_text(text)


BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefg", "bcdefgh", strict=True)
)

RUN_PLAN_CASES = {
    "garbage": (_write("{{{ : ["), "not valid YAML"),
    "a list": (_write("[1, 2]"), "mapping"),
    "nested too deep": (_write("a: " + "[" * 50_000 + "]" * 50_000), "plan.yaml"),
    "a YAML bomb": (_write(BOMB), "expands to over"),
    "over the size cap": (_write("a: " + "x" * (5 << 20)), "MiB"),
    "an unknown field": (_edit_plan(lambda d: d.__setitem__("zz", 1)), "unknown field 'zz'"),
    "a mistyped field": (
        _edit_plan(lambda d: d["config"]["rollout"].__setitem__("prompts_per_step", "two")),
        "field 'config.rollout.prompts_per_step'",
    ),
    "another model size": (_edit_plan(lambda d: d["config"]["tiny_model"].__setitem__("num_layers", 3)), "edited"),
    "another graph": (_edit_plan(lambda d: d["graph"].update(name="ppo", source="ppo")), "edited"),
    "a NaN learning rate, id removed": (
        _edit_plan(lambda d: (d["config"]["train"].__setitem__("lr", float("nan")), d.pop("id"))),
        "train.lr",
    ),
    "a folder": (lambda run: ((run / "plan.yaml").unlink(), (run / "plan.yaml").mkdir()), "not a run folder"),
    "missing": (lambda run: (run / "plan.yaml").unlink(), "not a run folder"),
}


@pytest.mark.parametrize("case", list(RUN_PLAN_CASES))
@pytest.mark.slow
def test_an_edited_plan_yaml_in_the_run_folder_is_refused_and_the_run_kept(case, run, capsys):
    change, expected = RUN_PLAN_CASES[case]
    change(run)
    metrics = (run / "metrics.jsonl").read_bytes()
    code, err = resume(capsys, run, "--steps", "3")
    assert code == 2 and expected in err, err[:2000]
    assert len(err) < 2000
    assert (run / "metrics.jsonl").read_bytes() == metrics
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000000", "step-000001"]


@pytest.mark.parametrize("what", ["an empty folder", "a folder of other things", "a file", "missing"])
def test_resume_of_something_that_is_no_run_is_refused_naming_it(what, tmp_path, capsys):
    target = tmp_path / "target"
    if what == "a file":
        target.write_text("hello")
    elif what != "missing":
        target.mkdir()
        if what == "a folder of other things":
            (target / "notes.txt").write_text("mine")
            (target / "checkpoints").mkdir()
    code, err = resume(capsys, target, "--steps", "1")
    assert code == 2 and str(target) in err, err
    assert not (target / "metrics.jsonl").exists()


# ------------------------------------------------------------------ checkpoints swapped or half-written


def _swap(a: Path, b: Path) -> None:
    data = a.read_bytes()
    a.write_bytes(b.read_bytes())
    b.write_bytes(data)


@pytest.mark.parametrize("file, expected", [("state.json", "field 'step'"), ("driver.json", "field 'snapshot.step'")])
def test_manifests_swapped_between_two_checkpoints_are_refused_naming_the_field(file, expected, run, capsys):
    _swap(run / "checkpoints" / "step-000000" / file, run / "checkpoints" / "step-000001" / file)
    code, err = resume(capsys, run, "--steps", "3")
    assert code == 2 and file in err and expected in err, err


def test_a_metrics_file_cut_mid_line_before_the_checkpoint_is_refused_and_kept(run, capsys):
    path = run / "metrics.jsonl"
    path.write_bytes(path.read_bytes()[:-30])
    before = path.read_bytes()
    code, err = resume(capsys, run, "--steps", "3")
    assert code == 2 and "metrics.jsonl" in err and "line 2" in err, err
    assert path.read_bytes() == before


@pytest.mark.parametrize("cut", [0, 10])
def test_a_truncated_newest_driver_safetensors_resumes_from_the_checkpoint_before_it(cut, run, capsys):
    path = run / "checkpoints" / "step-000001" / "driver.safetensors"
    path.write_bytes(path.read_bytes()[:cut])
    code, err = resume(capsys, run, "--steps", "3")
    assert code == 0, err
    assert "skipping a newer checkpoint" in err and "driver" in err and "step-000000" in err
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]


# ------------------------------------------------------------------ --plan FILE


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> dict[str, Any]:
    """The plan `flowrl plan grpo` writes for a small run, as data."""
    from flowrl.cli import main

    path = tmp_path_factory.mktemp("plan") / "plan.yaml"
    assert main(["plan", "grpo", "--out", str(path), *SETS]) == 0
    return yaml.safe_load(path.read_text())


def _plan_edit(change):
    """The plan with ``change`` applied, its id removed (an edit accepted) and one step to run."""

    def text(plan: dict[str, Any]) -> str:
        data = json.loads(json.dumps(plan))
        change(data)
        data.pop("id", None)
        data["config"]["steps"] = 1
        return yaml.safe_dump(data)

    return text


def _layout(section: str, **values: Any):
    def change(d: dict[str, Any]) -> None:
        target = d["layout"]
        for key in section.split("."):
            target = target[int(key)] if isinstance(target, list) else target[key]
        target.update(values)

    return _plan_edit(change)


PLAN_FILE_CASES = {
    "garbage bytes": (lambda p: "\x00\x89PNG garbage", "plan"),
    "empty": (lambda p: "", "field `graph`"),
    "a scalar": (lambda p: "42", "mapping"),
    "nested too deep": (lambda p: "a: " + "[" * 50_000 + "]" * 50_000, "not valid YAML"),
    "nested mappings": (lambda p: "{a: " * 5000 + "1" + "}" * 5000, "not valid YAML"),
    "a YAML bomb": (lambda p: BOMB, "expands to over"),
    "another graph": (_plan_edit(lambda d: d["graph"].update(name="ppo", source="ppo")), "made for graph"),
    "another graph fingerprint": (_plan_edit(lambda d: d["graph"].update(fingerprint="f" * 16)), "made for graph"),
    "an unknown field": (_plan_edit(lambda d: d.__setitem__("zz", {"a": 1})), "unknown field 'zz'"),
    "a mistyped models": (_plan_edit(lambda d: d.__setitem__("models", "all")), "field 'models'"),
    "10^9 nodes": (
        _plan_edit(lambda d: d["target"]["cluster"].update(nodes=10**9, devices_per_node=8)),
        "field 'target.cluster'",
    ),
    "a NaN peak": (
        _plan_edit(lambda d: d["target"]["cluster"]["hardware"].update(peak_flops_bf16=float("nan"))),
        "peak_flops_bf16",
    ),
    "another model size": (
        _plan_edit(lambda d: d["config"]["tiny_model"].update(num_layers=10**9)),
        "tiny_model",
    ),
    "10^12 prompts a step": (
        _plan_edit(lambda d: d["config"]["rollout"].update(prompts_per_step=10**12)),
        "rollout.prompts_per_step",
    ),
    "a group of 10^9 devices": (_layout("groups.0", devices=10**9), "field 'layout.groups[0].devices'"),
    "a group of no devices": (_layout("groups.0", devices=0), "field 'layout.groups[0].devices'"),
    "a negative first device": (_layout("groups.0", first=-5), "field 'layout.groups[0].first'"),
    "a first device past the cluster": (_layout("groups.0", first=3), "device group 'all' takes devices 3..3"),
    "dp of 10^9": (_layout("models.0.parallel", dp=10**9), "field 'layout.models[0].parallel.dp'"),
    "tp of 0": (_layout("models.0.parallel", tp=0), "field 'layout.models[0].parallel.tp'"),
    "a negative micro-batch": (_layout("models.0", micro_batch=-1), "field 'layout.models[0].micro_batch'"),
    "an unknown group": (_layout("models.0", group="ghost"), "unknown device group 'ghost'"),
    "10^9 generation replicas": (_layout("generation", replicas=10**9), "field 'layout.generation.replicas'"),
    "a generation tp of 0": (_layout("generation", tp=0), "field 'layout.generation.tp'"),
    "a staleness of 10^9": (_layout("rollout", staleness=10**9), "field 'layout.rollout.staleness'"),
    "a negative staleness": (_layout("rollout", staleness=-1), "field 'layout.rollout.staleness'"),
    "an overprovision of 10^6": (_layout("rollout", overprovision=1e6), "field 'layout.rollout.overprovision'"),
    "a chunk of no tokens": (_layout("rollout", chunk_tokens=0), "field 'layout.rollout.chunk_tokens'"),
    "a sync density over one": (_layout("weight_sync", density=2.0), "field 'layout.weight_sync.density'"),
}


@pytest.mark.parametrize("case", list(PLAN_FILE_CASES))
@pytest.mark.slow
def test_a_hostile_plan_file_is_refused_naming_what_is_wrong(case, planned, tmp_path, capsys):
    text, expected = PLAN_FILE_CASES[case]
    path = tmp_path / "plan.yaml"
    path.write_text(text(planned))
    code, _, err = run_cli(capsys, "run", "--plan", str(path), "--quiet", "--out", str(tmp_path / "runs"))
    assert code == 2 and expected in err and "Traceback" not in err, err[:2000]
    assert len(err) < 2000
    assert not (tmp_path / "runs" / "grpo" / "metrics.jsonl").exists()


def test_the_plan_as_written_still_runs(planned, tmp_path, capsys):
    path = tmp_path / "plan.yaml"
    path.write_text(_plan_edit(lambda d: None)(planned))
    code, _, err = run_cli(capsys, "run", "--plan", str(path), "--quiet", "--out", str(tmp_path / "runs"))
    assert code == 0, err
    assert len((tmp_path / "runs" / "grpo" / "metrics.jsonl").read_text().splitlines()) == 1
