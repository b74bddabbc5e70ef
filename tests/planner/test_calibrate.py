"""`flowrl calibrate`: the cost model fitted to what runs measured.

Real runs of the tiny model on the local backend write their plans and traces; the fit moves
the factors those runs measure, and later plans for the same machine are costed with them. Then the
user's path (the CLI's exit statuses and messages, calibrate, plan, run and resume an older run) and
the edges of reading a run back (corrupted files, evaluations between iterations, runs given twice,
plans without a layout), of refitting a spec an earlier calibration made, and of finding the
calibration for a cluster. Each test that plans or calibrates has a FLOWRL_HOME of its own; the runs
are shared (module fixtures)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import msgspec
import numpy as np
import pytest

from flowrl import cli
from flowrl.contract.hardware import Calibrated, save_hardware
from flowrl.contract.plan import dump_plan, load_plan
from flowrl.contract.workload import Histogram, LogNormal, mean_length
from flowrl.errors import ConfigError
from flowrl.planner.calibrate import fit, read_runs, scaled, sync_names, with_values
from flowrl.planner.hardware import (
    HardwareSpec,
    calibration_path,
    cluster_key,
    cost_provenance,
    cpu_cluster,
    load_hardware,
    parse_cluster,
    with_calibration,
)
from flowrl.planner.traces import read_run, steady
from flowrl.planner.workload import Fixed
from flowrl.plugins.manager import registry
from flowrl.runtime.trace import steady_window

pytestmark = pytest.mark.slow  # a module fixture trains and calibrates real runs: seconds

# fixed-length responses: the measured and the replayed runs see the same lengths
RUNS = {
    "a": ["rollout.prompts_per_step=8", "rollout.samples_per_prompt=8", "rollout.max_new_tokens=8"],
    "b": ["rollout.prompts_per_step=16", "rollout.samples_per_prompt=8", "rollout.max_new_tokens=16"],
    "c": ["rollout.prompts_per_step=8", "rollout.samples_per_prompt=16", "rollout.max_new_tokens=12"],
}


def _run(out: Path, name: str, settings: list[str], steps: int = 8) -> Path:
    argv = ["run", "grpo", "--steps", str(steps), "--out", str(out), "--name", name, "--quiet"]
    argv += ["--set", "rollout.ignore_eos=true", "--set", "checkpoint=false"]
    for s in settings:
        argv += ["--set", s]
    assert cli.main(argv) == 0
    return out / name


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("calibration-runs")
    return {name: _run(out, name, settings) for name, settings in RUNS.items()}


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A FLOWRL_HOME of this test's own: a calibration written here is read by no other test."""
    monkeypatch.setenv("FLOWRL_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_a_run_reads_back_as_its_steady_state(runs):
    m = read_run(runs["a"])
    assert {"rollout", "old_logprobs", "ref_logprobs", "train_actor"} <= set(m.tasks)
    assert m.iterations == 6  # 8 steps, the first 2 of warm-up
    assert 0 < m.tasks["train_actor"] < m.iteration_s
    assert m.response_length["rollout"] == pytest.approx(8.0)  # EOS ignored: every response is 8 tokens


def test_the_fit_matches_the_run_it_was_given(runs):
    (replay,) = read_runs([str(runs["a"])], registry())
    result = fit([replay])
    run = str(runs["a"])
    measured = result.measured[run]
    assert abs(result.after[run] / measured - 1) < 0.1
    assert abs(result.after[run] / measured - 1) < abs(result.before[run] / measured - 1)
    cal = result.hardware.calibration
    assert cal.runs == [run] and "task_overhead" in cal.factors and cal.factors["task_overhead"] == [run]
    assert cal.fit[run][2] == pytest.approx(measured, rel=1e-3)
    # links and tensor-parallel host work are not measured by one device's run: left as they were
    assert "intra_node_bandwidth" not in cal.factors and "tp_op_overhead" not in cal.factors


def test_two_runs_predict_a_third_better_than_the_nominal_machine(runs):
    replays = read_runs([str(runs[k]) for k in ("a", "b", "c")], registry())
    result = fit(replays[:2])
    held = replays[2]
    measured = held.measured.iteration_s
    before = held.measured.plan.layout.predicted.iteration_s
    after = held.predict(result.hardware).iteration_s
    # alone on this box: nominal 69% off, fitted 10% off; under `pytest -n 2` the other worker's load moves one
    # run's measured step by a third against another's (fitted 37% off once, nominal ~63%): a loose bound, and
    # the behaviour itself, closer than the nominal machine
    assert abs(after / measured - 1) < 0.5
    assert abs(after / measured - 1) < abs(before / measured - 1)


def test_calibrate_then_plan_uses_the_fit_and_says_so(runs, home, capsys):
    assert cli.main(["plan", "grpo", "--explain", *sum((["--set", s] for s in RUNS["a"]), [])]) == 0
    assert "UNCALIBRATED" in capsys.readouterr().out
    assert cli.main(["calibrate", str(runs["a"])]) == 0
    out = capsys.readouterr().out
    assert "task_overhead" in out and "written to" in out
    saved = home / "hardware" / "calibrated" / "local.yaml"
    assert saved.is_file()
    settings = [*sum((["--set", s] for s in [*RUNS["a"], "rollout.ignore_eos=true"]), [])]
    assert cli.main(["plan", "grpo", "--explain", *settings]) == 0
    explained = capsys.readouterr().out
    assert "calibrated by `flowrl calibrate`" in explained and str(runs["a"]) in explained
    predicted = float(explained.split("winner: ")[1].split(" s/iteration")[0])
    measured = read_run(runs["a"]).iteration_s
    assert abs(predicted / measured - 1) < 0.15 or abs(predicted - measured) < 0.01  # the plan prints 2 decimals


def _err(capsys) -> str:
    return " ".join(capsys.readouterr().err.split())


def test_calibrate_refuses_what_it_cannot_read(runs, home, tmp_path, capsys):
    assert cli.main(["calibrate", str(tmp_path / "nowhere")]) == 2
    assert "no such folder" in _err(capsys)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["calibrate", str(empty)]) == 2
    assert "no plan.yaml" in _err(capsys)
    short = _run(tmp_path, "short", RUNS["a"], steps=3)
    assert cli.main(["calibrate", str(short)]) == 2
    assert "Run more steps" in _err(capsys)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "plan.yaml").write_text((runs["a"] / "plan.yaml").read_text())
    (broken / "trace.json").write_text("{not json")
    assert cli.main(["calibrate", str(broken)]) == 2
    assert "trace.json cannot be read" in _err(capsys)


def test_a_graph_file_is_built_only_when_named(home, tmp_path, capsys):
    source = Path(__file__).parents[2] / "graphs" / "grpo.py"
    mine = tmp_path / "my_grpo.py"
    mine.write_text(source.read_text().replace('Graph("grpo")', 'Graph("my_grpo")'))
    argv = ["run", str(mine), "--steps", "5", "--out", str(tmp_path), "--quiet", "--set", "checkpoint=false"]
    argv += [*sum((["--set", s] for s in RUNS["a"]), [])]
    assert cli.main(argv) == 0
    run = tmp_path / "my_grpo"
    assert cli.main(["calibrate", str(run)]) == 2
    err = capsys.readouterr().err
    assert "--graph" in err and "Python code" in err
    assert cli.main(["calibrate", str(run), "--graph", str(mine)]) == 0


def test_runs_of_two_clusters_are_refused(runs, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    for name in ("trace.json", "metrics.jsonl"):
        (other / name).write_text((runs["a"] / name).read_text())
    from flowrl.contract.plan import dump_plan, load_plan

    plan = load_plan(runs["a"] / "plan.yaml")
    hw = msgspec.structs.replace(plan.target.cluster.hardware, name="someone-elses-gpu")
    cluster = msgspec.structs.replace(plan.target.cluster, hardware=hw)
    edited = msgspec.structs.replace(plan, target=msgspec.structs.replace(plan.target, cluster=cluster))
    dump_plan(edited.sealed(), other / "plan.yaml")
    with pytest.raises(ConfigError, match="different clusters"):
        read_runs([str(runs["a"]), str(other)], registry())


# ------------------------------------------------------------------ pieces


def test_a_calibration_is_found_by_its_cluster_and_keeps_todays_memory(home):
    machine = HardwareSpec(
        name="local-cpu",
        peak_flops_bf16=1e11,
        peak_flops_fp32=1e11,
        memory_bytes=2**33,
        memory_bandwidth=2e10,
        intra_node_bandwidth=2e10,
        inter_node_bandwidth=2e10,
        devices_per_node=1,
    )
    two = cpu_cluster(machine, 2)
    assert cluster_key(two) == "cpu-2" and with_calibration(two) is two
    from flowrl.contract.hardware import Calibrated

    provenance = Calibrated(runs=["runs/x"], factors={"task_overhead": ["runs/x"]})
    fitted = msgspec.structs.replace(
        two.hardware, task_overhead=0.004, kernel_overhead=0.5, memory_bytes=123, calibration=provenance
    )
    path = calibration_path(two)
    path.parent.mkdir(parents=True)
    path.write_bytes(msgspec.yaml.encode(fitted))
    used = with_calibration(two)
    assert used.hardware.task_overhead == 0.004 and used.hardware.memory_bytes == two.hardware.memory_bytes
    assert used.hardware.kernel_overhead == two.hardware.kernel_overhead  # only the fitted factors are applied
    one = msgspec.structs.replace(two, devices_per_node=1, hardware=machine)
    assert cluster_key(one) == "local" and with_calibration(one).hardware.task_overhead == 0.0


def test_provenance_says_how_far_to_trust_a_prediction():
    from flowrl.planner.hardware import HARDWARE_PRESETS

    assert "uncalibrated for this cluster" in cost_provenance(HARDWARE_PRESETS["H100-80G"])
    nominal = msgspec.structs.replace(HARDWARE_PRESETS["H100-80G"], name="local-cpu-nominal")
    assert "UNCALIBRATED" in cost_provenance(nominal)
    profiled = msgspec.structs.replace(HARDWARE_PRESETS["H100-80G"], name="local-cpu")
    assert "not fitted to a run" in cost_provenance(profiled)


def test_lengths_are_scaled_to_what_the_run_produced():
    assert scaled(Fixed(value=4), 6.0, 8) == Fixed(value=6)
    assert scaled(Fixed(value=4), 60.0, 8) == Fixed(value=8)  # never past the budget
    lengths = scaled(Histogram(lengths=[2, 4], weights=[1.0, 1.0]), 6.0, 16)
    assert mean_length(lengths) == pytest.approx(6.0)
    tail = scaled(
        LogNormal(median=100, sigma=0.5, max=4096), 2 * mean_length(LogNormal(median=100, sigma=0.5, max=4096)), 4096
    )
    assert tail.median == pytest.approx(200)


def test_steady_state_skips_the_warm_up():
    assert steady(list(range(10))) == list(range(2, 10))
    assert steady(list(range(40))) == list(range(4, 40))
    tasks = [("t", ("g",), float(i), i + 0.5, i) for i in range(20)]
    window = steady_window(tasks, 4)
    assert [t[4] for t in window] == [9, 10, 11, 12]  # the middle of iterations 2..19


def test_the_timeline_shows_a_few_measured_iterations_and_says_uncalibrated(runs, tmp_path):
    import matplotlib.image

    png = runs["a"] / "timeline.png"
    assert png.is_file() and matplotlib.image.imread(png).shape[0] > 100
    trace = json.loads((runs["a"] / "trace.json").read_text())
    assert any(e.get("ph") == "X" for e in trace["traceEvents"])


def test_simulated_tasks_pay_the_fitted_overheads():
    from flowrl.planner.cost import CostModel
    from flowrl.planner.hardware import HARDWARE_PRESETS
    from flowrl.planner.modelspec import MODEL_PRESETS

    hw = HARDWARE_PRESETS["H100-80G"]
    spec = MODEL_PRESETS["llama3-8b"]
    batch, context = np.array([64.0]), np.array([512.0])
    plain = CostModel(spec, msgspec.structs.replace(hw, decode_step_overhead=0.0, decode_row_overhead=0.0))
    busy = CostModel(spec, msgspec.structs.replace(hw, decode_step_overhead=1e-3, decode_row_overhead=1e-5))
    extra = busy.decode_step(batch, context, 1) - plain.decode_step(batch, context, 1)
    assert extra[0] == pytest.approx(1e-3 + 64 * 1e-5)
    # a captured decode graph (vLLM on a GPU) pays no host work per tensor-parallel module call; the CPU does
    captured = plain.for_engine("vllm", captured=True)
    assert captured.decode_step(batch, context, 4)[0] < plain.decode_step(batch, context, 4)[0]
    cpu = msgspec.structs.replace(hw, name="cpu")
    assert CostModel(spec, cpu).for_engine("vllm", captured=True).decode_step(batch, context, 4)[0] == pytest.approx(
        CostModel(spec, cpu).decode_step(batch, context, 4)[0]
    )


# ------------------------------------------------------------------ the user's runs

# the user's runs: fixed-length responses, a small batch: each run takes a few seconds
SMALL = [
    "rollout.prompts_per_step=8",
    "rollout.samples_per_prompt=4",
    "rollout.ignore_eos=true",
    "rollout.max_new_tokens=8",
]


def _sets(settings: list[str]) -> list[str]:
    return [a for s in settings for a in ("--set", s)]


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of `flowrl ARGV`; a raw exception out of the CLI fails the test."""
    capsys.readouterr()
    try:
        rc = cli.main([str(a) for a in argv])
    except Exception as exc:  # what a user sees as a traceback
        pytest.fail(
            f"`flowrl {' '.join(map(str, argv))}` raised {type(exc).__name__}: {exc}; expected exit status 2 "
            "and a message naming the file or field at fault"
        )
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(scope="module")
def user_runs(tmp_path_factory) -> dict[str, Path]:
    """``base``: grpo, 6 steps, checkpointed (resumable); ``eval``: the same with an evaluation after every
    step. Both planned uncalibrated (an empty FLOWRL_HOME)."""
    out = tmp_path_factory.mktemp("user-runs")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLOWRL_HOME", str(out / "home"))
        argv = ["run", "grpo", "--steps", "6", "--out", str(out), "--quiet", *_sets(SMALL)]
        assert cli.main([*argv, "--name", "base"]) == 0
        evals = ["checkpoint=false", "eval.every=1", "eval.prompts=64", "eval.samples=4"]
        assert cli.main([*argv, "--name", "eval", *_sets(evals)]) == 0
    return {"base": out / "base", "eval": out / "eval"}


@pytest.fixture(scope="module")
def fitted(user_runs):
    """The fit of the base run (a HardwareSpec with its provenance), computed once."""
    (replay,) = read_runs([str(user_runs["base"])], registry())
    return fit([replay]).hardware


def _copy(run: Path, dst: Path, *, plan=None) -> Path:
    """A copy of a run folder's plan, trace and metrics (``plan``: a changed plan, given its new id)."""
    dst.mkdir(parents=True)
    for name in ("plan.yaml", "trace.json", "metrics.jsonl"):
        shutil.copy(run / name, dst / name)
    if plan is not None:
        dump_plan(msgspec.structs.replace(plan, id=plan.content_id()), dst / "plan.yaml")
    return dst


def _with_hardware(plan, **fields):
    hw = msgspec.structs.replace(plan.target.cluster.hardware, **fields)
    cluster = msgspec.structs.replace(plan.target.cluster, hardware=hw)
    return msgspec.structs.replace(plan, target=msgspec.structs.replace(plan.target, cluster=cluster))


# ------------------------------------------------------------------ the user's path, end to end


def test_calibrate_plan_run_and_resume_an_older_run(user_runs, home, tmp_path, capsys):
    import matplotlib.image

    base = user_runs["base"]
    older = _copy(base, tmp_path / "older")  # a run planned before the calibration, resumed after it
    shutil.copytree(base / "checkpoints", older / "checkpoints")
    assert matplotlib.image.imread(base / "timeline.png").shape[0] > 100

    rc, out, err = _cli(capsys, "calibrate", base)
    assert rc == 0, err
    assert "calibrating cluster 'local'" in out
    spec = load_hardware(home / "hardware" / "calibrated" / "local.yaml")  # valid YAML that loads
    before, after, measured = spec.calibration.fit[str(base)]
    assert abs(math.log(after / measured)) <= abs(math.log(before / measured))  # the fit is no worse

    # --out: an existing file is kept without --force, replaced with it
    existing = tmp_path / "fit.yaml"
    existing.write_text("keep me\n")
    rc, _, err = _cli(capsys, "calibrate", base, "--out", existing)
    assert rc == 2 and "--force" in err and existing.read_text() == "keep me\n"
    rc, _, err = _cli(capsys, "calibrate", base, "--out", existing, "--force")
    assert rc == 0, err
    assert load_hardware(existing).calibration is not None

    rc, out, err = _cli(capsys, "plan", "grpo", "--explain", *_sets(SMALL))
    assert rc == 0, err
    assert "cost model: calibrated by `flowrl calibrate`" in out and str(base) in out
    rc, out, err = _cli(capsys, "plan", "grpo", "--cluster", "8xH100-80G", "--model", "llama3-8b", "--explain")
    assert rc == 0, err
    assert "uncalibrated for this cluster" in out

    # a new run is planned with the calibration, and still runs
    argv = ["run", "grpo", "--steps", "5", "--out", tmp_path, "--name", "after", "--quiet"]
    rc, out, err = _cli(capsys, *argv, *_sets([*SMALL, "checkpoint=false"]))
    assert rc == 0, err
    assert "calibrated prediction" in out and "uncalibrated" not in out
    assert load_plan(tmp_path / "after" / "plan.yaml").target.cluster.hardware.calibration is not None
    assert matplotlib.image.imread(tmp_path / "after" / "timeline.png").shape[0] > 100

    # the older run resumes with its own (uncalibrated) plan
    rc, out, err = _cli(capsys, "run", "--resume", older, "--steps", "8", "--quiet")
    assert rc == 0, err
    resumed = load_plan(older / "plan.yaml")
    assert resumed.config.steps == 8 and resumed.target.cluster.hardware.calibration is None


def test_cluster_local_picks_up_the_local_calibration(user_runs, fitted, home, capsys):
    """`flowrl calibrate` says "plans for 'local' now use it"; `--cluster local` is refused instead
    ("no hardware profile ... Run `flowrl profile` first") when no `flowrl profile` has run, although the
    machine the run ran on (its nominal speeds) has just been calibrated."""
    cluster = read_run(user_runs["base"]).plan.target.cluster
    save_hardware(fitted, calibration_path(cluster))
    rc, out, err = _cli(capsys, "plan", "grpo", "--explain", *_sets(SMALL))
    assert rc == 0 and "calibrated by `flowrl calibrate`" in out  # no --cluster: the calibration is used
    rc, out, err = _cli(capsys, "plan", "grpo", "--cluster", "local", "--explain", *_sets(SMALL))
    assert rc == 0, f"--cluster local after `flowrl calibrate` of this machine: {err}"
    assert "calibrated by `flowrl calibrate`" in out


# ------------------------------------------------------------------ reading a run back


def test_evaluations_between_iterations_are_not_iteration_time(user_runs):
    """With eval.every=1 each gap between two iterations' ends also holds an evaluation (it is not a task
    in trace.json): the measured iteration is then ~4x the sum of its tasks, though the plan runs every
    task one after another on one device group, and the fit makes training look 4x slower than it is."""
    m = read_run(user_runs["eval"])
    assert m.plan.layout.placement == "colocate" and m.plan.layout.rollout.mode == "sync"
    tasks = sum(m.tasks.values())
    assert m.iteration_s < 1.5 * tasks, (
        f"measured {m.iteration_s:.3f} s/iteration from tasks taking {tasks:.3f} s: the evaluations after "
        "each step are counted as training time"
    )


def test_a_run_folder_given_twice_is_one_run(user_runs, home, capsys):
    """`flowrl calibrate R R/` fitted "2 run(s)", weighting the one run twice against the prior, and
    recorded it twice in the provenance (--explain: "to 2 run(s)")."""
    base = str(user_runs["base"])
    rc, out, err = _cli(capsys, "calibrate", base, base + "/")
    if rc == 2:  # refusing the repeat is fine too, if it says which folder
        assert base in err and "twice" in err
        return
    assert rc == 0, err
    assert "from 1 run(s)" in out
    runs_in_fit = load_hardware(home / "hardware" / "calibrated" / "local.yaml").calibration.runs
    assert len(runs_in_fit) == 1, runs_in_fit


def _bad_metrics(folder: Path, kind: str) -> None:
    path = folder / "metrics.jsonl"
    if kind == "not-an-object":
        path.write_text(path.read_text() + "[1, 2]\n")
    elif kind == "not-utf8":
        path.write_bytes(path.read_bytes() + b"\xff\xfe garbage\n")
    elif kind == "nan-length":
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        for record in lines:
            if "rollout/response_length" in record:
                record["rollout/response_length"] = float("nan")
        path.write_text("".join(json.dumps(r) + "\n" for r in lines))


@pytest.mark.parametrize("kind", ["not-an-object", "not-utf8", "nan-length"])
def test_a_corrupted_metrics_file_is_a_user_error(user_runs, home, tmp_path, capsys, kind):
    """A metrics.jsonl line that is JSON but not an object, bytes that are not UTF-8, or a NaN response
    length: tracebacks (AttributeError, UnicodeDecodeError, 'cannot convert float NaN to integer')."""
    folder = _copy(user_runs["base"], tmp_path / "run")
    _bad_metrics(folder, kind)
    rc, _, err = _cli(capsys, "calibrate", folder, "--out", tmp_path / "fit.yaml")
    assert rc in (0, 2)  # skipping what cannot be read is fine; so is refusing it, naming the file
    if rc == 2:
        assert "metrics.jsonl" in err


def _bad_trace(folder: Path, kind: str) -> None:
    path = folder / "trace.json"
    trace = json.loads(path.read_text())
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    if kind == "old-no-iterations":  # a trace from before iterations were recorded
        for e in spans:
            e.get("args", {}).pop("iteration", None)
    elif kind == "array-format":  # Chrome's other trace format: a bare list of events
        trace = trace["traceEvents"]
    elif kind == "no-dur":
        for e in spans:
            e.pop("dur")
    elif kind == "iteration-null":
        for e in spans:
            if "iteration" in e.get("args", {}):
                e["args"]["iteration"] = None
    elif kind == "events-not-a-list":
        trace = {"traceEvents": 5}
    elif kind == "all-at-one-instant":  # zero-duration spans, every one at the same time
        for e in spans:
            e["ts"], e["dur"] = 1000.0, 0.0
    path.write_text(json.dumps(trace))


@pytest.mark.parametrize(
    "kind", ["old-no-iterations", "array-format", "no-dur", "iteration-null", "events-not-a-list", "all-at-one-instant"]
)
def test_a_malformed_trace_is_a_user_error(user_runs, home, tmp_path, capsys, kind):
    """Only an old trace (no iteration args) got a message; the others raised AttributeError, KeyError,
    TypeError, or ZeroDivisionError (a zero-second iteration) out of the CLI."""
    folder = _copy(user_runs["base"], tmp_path / "run")
    _bad_trace(folder, kind)
    rc, _, err = _cli(capsys, "calibrate", folder, "--out", tmp_path / "fit.yaml")
    if kind == "array-format" and rc == 0:  # reading Chrome's array format is fine too
        return
    assert rc == 2
    assert "trace.json" in err


def test_a_plan_without_a_layout_names_the_run(user_runs, home, tmp_path, capsys):
    """The error was "plan 6e4e... has no layout to simulate (it was not placed)": it names neither the
    run folder nor its plan.yaml."""
    plan = load_plan(user_runs["base"] / "plan.yaml")
    folder = _copy(user_runs["base"], tmp_path / "unplaced", plan=msgspec.structs.replace(plan, layout=None))
    rc, _, err = _cli(capsys, "calibrate", folder, "--out", tmp_path / "fit.yaml")
    assert rc == 2
    assert str(folder) in err.replace("\n  ", " ") or "plan.yaml" in err


def test_a_wrong_graph_file_is_named_in_the_error(user_runs, home, tmp_path, capsys):
    """A run of a graph file of the user's own, calibrated with `--graph` naming a file that is not there:
    the error told the user to add `--graph <the run's file>`, as if no --graph had been given, and never
    said that the file given does not exist."""
    from flowrl.graph.loading import build_graph, find_graph

    mine = tmp_path / "mine.py"
    source = Path(__file__).parents[2] / "graphs" / "grpo.py"
    mine.write_text(source.read_text().replace('Graph("grpo")', 'Graph("mine")'))
    plan = load_plan(user_runs["base"] / "plan.yaml")
    graph = build_graph(find_graph(str(mine), {}, registry()), plan.config)
    ref = msgspec.structs.replace(plan.graph, name=graph.name, source=str(mine), fingerprint=graph.fingerprint())
    folder = _copy(user_runs["base"], tmp_path / "mine-run", plan=msgspec.structs.replace(plan, graph=ref))
    assert _cli(capsys, "calibrate", folder, "--graph", mine, "--out", tmp_path / "a.yaml")[0] == 0
    missing = tmp_path / "nothere.py"
    rc, _, err = _cli(capsys, "calibrate", folder, "--graph", missing, "--out", tmp_path / "b.yaml")
    assert rc == 2
    assert "nothere.py" in err, err


# ------------------------------------------------------------------ refitting, provenance, lookup


def test_a_factor_an_earlier_fit_drove_to_almost_zero_is_fitted_again(user_runs, home, tmp_path):
    """A factor counts as measured when tripling it moves a residual; one an earlier fit left at 1e-13
    (the first fit here left decode_step_overhead at 7.7e-14) moves nothing when tripled, so a run planned
    on that calibrated spec never fits it again, though the same run fits it from 0."""
    plan = load_plan(user_runs["base"] / "plan.yaml")
    (replay,) = read_runs([str(user_runs["base"])], registry())
    assert "task_overhead" in fit([replay]).factors  # the run measures it (fitted from 0)
    folder = _copy(user_runs["base"], tmp_path / "refit", plan=_with_hardware(plan, task_overhead=1e-13))
    (replay,) = read_runs([str(folder)], registry())
    assert "task_overhead" in fit([replay]).factors


def test_a_refit_keeps_where_the_factors_it_does_not_fit_came_from(user_runs, home, tmp_path):
    """A run planned on a calibrated spec, calibrated: the factors it cannot measure keep the earlier fit's
    values, but the new provenance forgets the earlier runs and says "every other factor is the spec's own"."""
    plan = load_plan(user_runs["base"] / "plan.yaml")
    earlier = Calibrated(
        runs=["runs/tp2"],
        factors={"tp_op_overhead": ["runs/tp2"]},
        when="2026-01-01",
        fit={"runs/tp2": (1.0, 1.0, 1.0)},
    )
    plan = _with_hardware(plan, tp_op_overhead=5e-4, calibration=earlier)
    folder = _copy(user_runs["base"], tmp_path / "on-calibrated", plan=plan)
    (replay,) = read_runs([str(folder)], registry())
    result = fit([replay])
    assert result.hardware.tp_op_overhead == pytest.approx(5e-4)  # not measured by one device: kept
    assert "runs/tp2" in cost_provenance(result.hardware), cost_provenance(result.hardware)


def test_a_cluster_file_keeps_its_own_hardware_beside_a_calibration(home, tmp_path):
    """A calibration of 8xH100-80G replaced the whole hardware of every cluster labelled 1x8xH100-80G,
    so a cluster file's own `host_bandwidth` (a field no calibration fits) was silently dropped."""
    preset = parse_cluster("8xH100-80G")
    mark = Calibrated(runs=["runs/h100"], factors={"task_overhead": ["runs/h100"]}, when="2026-01-01")
    save_hardware(
        msgspec.structs.replace(preset.hardware, task_overhead=0.01, calibration=mark), calibration_path(preset)
    )
    assert with_calibration(preset).hardware.task_overhead == 0.01
    file = tmp_path / "pcie.yaml"
    file.write_text("nodes: 1\ndevices_per_node: 8\nhardware:\n  preset: H100-80G\n  host_bandwidth: 1.0e9\n")
    used = with_calibration(parse_cluster(str(file)))
    assert used.hardware.host_bandwidth == 1e9


def test_two_policies_with_their_own_generators_and_syncs_are_fitted(home, tmp_path, capsys):
    """two_agent (generate nodes `propose` and `solve`, syncs `sync:train_proposer` / `sync:train_solver`):
    a trace made of the simulator's own spans under other factors is read with every task and fitted."""
    out = tmp_path / "ta"
    rc, _, err = _cli(
        capsys, "plan", "two_agent", "--cluster", "2xH100-80G", "--model", "llama3-8b", "--placement",
        "disaggregated", "--budget", "2", "--out", out / "plan.yaml",
    )  # fmt: skip
    assert rc == 0, err
    (out / "metrics.jsonl").write_text("")
    plan = load_plan(out / "plan.yaml")
    from flowrl import api
    from flowrl.planner.passes import replay

    graph = api.graph_for_plan(plan, registry())
    truth = with_values(plan.target.cluster.hardware, {"sync_tensor_overhead": 2e-2, "kernel_overhead": 1e-4})
    target = msgspec.structs.replace(plan.target, cluster=msgspec.structs.replace(plan.target.cluster, hardware=truth))
    result = replay(graph, plan, registry(), target)
    back = {v: f"sync:{k}" for k, v in sync_names(graph).items()}
    events = [
        {"name": back.get(s.task, s.task), "ph": "X", "pid": 0, "tid": 0, "ts": s.start * 1e6,
         "dur": (s.end - s.start) * 1e6, "args": {"iteration": s.iteration}}
        for s in result.spans if s.end > s.start
    ]  # fmt: skip
    (out / "trace.json").write_text(json.dumps({"traceEvents": events}))
    (r,) = read_runs([str(out)], registry())
    assert {"propose", "solve", "weight_sync", "weight_sync:solver"} <= set(r.measured.tasks)
    fitted = fit([r])
    assert abs(fitted.after[str(out)] / fitted.measured[str(out)] - 1) < 0.05
