"""benchmarks/tuner_choice.py, small: short calibration runs of the profiled tuner's candidates fit the
hardware the tuner then ranks on; its top two candidates each run their own plan on this machine as two Ray
devices, the times to a (low) target reward are measured from the runs' own metrics, the report ends in
well-formed JSON, and the verdict follows from the measured numbers. Whether the pick won is the full
benchmark's question (noise decides it here), not this test's."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers import benchmark_module

from flowrl import api
from flowrl.contract.plan import load_plan
from flowrl.plugins.manager import registry

pytest.importorskip("ray")


# one private Ray for the module (tests/conftest.py); runs end to end on Ray workers
pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.slow]


@pytest.fixture(scope="module")
def bench():
    """The benchmark module (it imports its sibling ``cpu2`` as a script does)."""
    with benchmark_module("tuner_choice") as module:
        yield module


def test_two_candidates_run_their_own_plans_and_the_verdict_follows_the_measured_times(tmp_path, bench):
    _, cfg = api.load("grpo", overrides=["executor=ray", "device=cpu"])
    cluster = api.local_target(cfg, registry(), devices=2).cluster
    progress: list[str] = []
    results = bench.choose(
        cluster, tmp_path, objectives=("throughput",), top=2, repeats=1, steps=3, prompts=4, samples=4,
        target=0.0, calibrate_steps=4, emit=progress.append,
    )  # fmt: skip
    lines = bench.report(results)
    assert json.loads(lines[-1]) == results[0]  # the last line is the JSON record
    line = results[0]
    assert (line["bench"], line["objective"], line["cluster"], line["repeats"]) == ("tuner_choice", "throughput",
                                                                                      "cpu:2", 1)  # fmt: skip
    first, second = line["candidates"]
    assert [first["rank"], second["rank"]] == [1, 2] and first["plan"] != second["plan"]
    assert first["predicted_s_per_iter"] <= second["predicted_s_per_iter"]  # ranked by throughput
    for c in (first, second):
        [run] = map(Path, c["runs"])
        planned = load_plan(run / "plan.yaml")  # what ran is the candidate's own plan
        assert planned.layout.summary() == c["plan"]
        assert planned.objective.iteration_s == pytest.approx(c["predicted_s_per_iter"], abs=1e-4)
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
        steps = [r for r in rows if "step_seconds" in r]
        assert len(steps) == 3
        # the target 0.0 is reached at the first step: its wall-clock, measured
        assert c["measured_steps_to_target"] == [1]
        assert c["measured_s_to_target"] == [round(steps[0]["step_seconds"], 2)] and steps[0]["step_seconds"] > 0
        assert c["samples_per_s"] == pytest.approx(16 * 3 / sum(r["step_seconds"] for r in steps), rel=0.01)
    assert first["runs"] != second["runs"]
    t1, t2 = first["measured_s_to_target"][0], second["measured_s_to_target"][0]
    assert line["noise_s"] == 0.0  # one repeat: no spread measured
    assert line["pick_was_fastest"] == (t1 <= t2)
    assert line["measured_fastest_rank"] == (1 if t1 <= t2 else 2)
    assert [p for p in progress if p.startswith("[")][-2:] == [
        f"[1/2] running plan1 repeat 1: {first['plan']}",
        f"[2/2] running plan2 repeat 1: {second['plan']}",
    ]
    # first, short runs of the profiled ranking's candidates, and the ranking above made on hardware fitted to them
    calibration = line["calibration"]
    short = [Path(r["run"]) for r in calibration["runs"]]
    assert calibration["steps"] == 4 and len(short) == 2
    assert all(run.parent == tmp_path / "calibration" for run in short)
    assert not set(short) & {Path(r) for c in line["candidates"] for r in c["runs"]}  # the judged runs are others
    for run in short:
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
        assert len([r for r in rows if "step_seconds" in r]) == 4
    off = [
        abs(math.log(r[key] / r["measured_s_per_iter"]))
        for r in calibration["runs"]
        for key in ("predicted_profiled", "predicted_calibrated")
    ]
    assert sum(off[1::2]) < sum(off[::2])  # the fit brought the predictions toward what the short runs measured
    assert calibration["factors"]
    for c in (first, second):
        hardware = load_plan(Path(c["runs"][0]) / "plan.yaml").target.cluster.hardware
        assert hardware.calibration is not None and set(hardware.calibration.runs) == set(map(str, short))
    assert any("pick was the fastest to target within the noise" in x for x in lines)


def test_the_verdict_weighs_the_pick_against_the_best_other_within_the_spread_of_repeats(bench):
    def candidates(*times):
        return [{"rank": i, "measured_s_to_target": list(t)} for i, t in enumerate(times, 1)]

    # noise: the widest spread, 1.0 s; the pick's 10.5 s is more than the best other's 9.3 s + 1.0 s
    assert bench.verdict(candidates([10.0, 11.0], [9.0, 9.6], [20.0, 20.0])) == {
        "pick_was_fastest": False,
        "noise_s": 1.0,
        "pick_mean_s": 10.5,
        "best_other_mean_s": 9.3,
        "measured_fastest_rank": 2,
    }
    assert bench.verdict(candidates([10.0, 10.2], [9.8, 10.4]))["pick_was_fastest"] is True  # within 0.6 s
    assert bench.verdict(candidates([10.0, 10.2], [8.0, 8.2]))["pick_was_fastest"] is False
    missed = bench.verdict(candidates([10.0, None], [30.0, 31.0]))  # the pick missed the target once
    assert missed["pick_was_fastest"] is False and missed["measured_fastest_rank"] == 2
    assert bench.verdict(candidates([12.0], [None]))["pick_was_fastest"] is True  # only the pick got there
    assert bench.verdict(candidates([None], [None]))["pick_was_fastest"] is None  # nobody did: undecided
