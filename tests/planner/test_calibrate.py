"""`flowrl calibrate`: the cost model fitted to what runs measured (issue 26).

Real runs of the tiny model on the local backend write their plans and traces; the fit moves
the factors those runs measure, and later plans for the same machine are costed with them."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import numpy as np
import pytest

from flowrl import cli
from flowrl.errors import ConfigError
from flowrl.planner.calibrate import fit, read_runs, scaled
from flowrl.planner.hardware import (
    HardwareSpec,
    calibration_path,
    cluster_key,
    cost_provenance,
    cpu_cluster,
    with_calibration,
)
from flowrl.planner.traces import read_run, steady
from flowrl.planner.workload import Fixed, Histogram, LogNormal, mean_length
from flowrl.plugins.manager import registry
from flowrl.runtime.trace import steady_window

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
    assert abs(after / measured - 1) < 0.3
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
    from flowrl.planner.plan import dump_plan, load_plan

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
    from flowrl.planner.hardware import Calibrated

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
