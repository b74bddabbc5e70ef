"""Time to target as the tuner's objective: a plan faster per iteration whose stale samples cost more
iterations loses to an on-policy plan under ``--objective time-to-target``; the published prior alone does
not overturn a clear per-step win; plans record the objective (old plans keep their ids); ``flowrl
calibrate`` fits the sample-efficiency penalties to runs' reward curves (synthetic metrics.jsonl and
plan.yaml files here, and two real tiny runs through the CLI) and plans read the fit; ``--explain`` prints
samples/s beside time to target and why the winner wins; a bad ``--objective`` is a user error."""

from __future__ import annotations

import json
import math
from pathlib import Path

import msgspec
import pytest

from flowrl import api, cli
from flowrl.contract.layout import RolloutPolicy
from flowrl.contract.objective import SampleEfficiency
from flowrl.contract.plan import dump_plan, load_plan
from flowrl.contract.workload import LogNormal
from flowrl.errors import ConfigError
from flowrl.planner.autotune import Tuner
from flowrl.planner.hardware import parse_cluster
from flowrl.planner.modelspec import MODEL_PRESETS
from flowrl.planner.reward_curves import WINDOW, fit_efficiency, read_curve
from flowrl.planner.sample_efficiency import PRIOR, Objective, efficiency_path, features, in_use, save_efficiency
from flowrl.planner.workload import WorkloadSpec

# a long tail on 8 GPUs: overlapping policies (async + partial) win per iteration by a wide margin
TAIL = WorkloadSpec(
    prompts_per_step=64,
    samples_per_prompt=4,
    prompt_length=256,
    response_length=LogNormal(median=256.0, sigma=1.2, max=4096),
)
STALE_COSTS = SampleEfficiency(staleness=1.0, offpolicy=1.0, partial=10.0, source="calibrated", runs=["a", "b"])
SYNC = RolloutPolicy()
ONE_OFF = RolloutPolicy(mode="one_step_off", staleness=1)
ASYNC = RolloutPolicy(mode="async", staleness=2, partial=True, overprovision=0.25)


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A FLOWRL_HOME of this test's own: a calibration written here is read by no other test."""
    monkeypatch.setenv("FLOWRL_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def tune(kind: str, efficiency: SampleEfficiency = PRIOR, steps: int = 100):
    graph, _ = api.load("grpo")
    objective = Objective(kind=kind, target_steps=steps, efficiency=efficiency)
    tuner = Tuner(graph, MODEL_PRESETS["qwen2.5-0.5b"], parse_cluster("8xH100-80G"), TAIL, objective=objective)
    return tuner.search(budget_s=2)


# ------------------------------------------------------------------ the objective


@pytest.mark.slow
def test_stale_samples_that_cost_iterations_flip_the_choice_to_an_on_policy_plan():
    fast = tune("throughput", STALE_COSTS)
    soon = tune("time-to-target", STALE_COSTS)
    # per iteration, a policy whose samples are stale or recycled (running ahead, or partial) wins
    assert features(fast.best.rollout) != (0.0, 0.0, 0.0), fast.best.summary()
    assert soon.best.rollout == SYNC, soon.best.summary()
    ttt = Objective(kind="time-to-target", target_steps=100, efficiency=STALE_COSTS)
    best = soon.ranked[0]
    assert best.result.iteration_s > fast.ranked[0].result.iteration_s  # slower per iteration ...
    # ... and sooner at the target than the throughput winner and every other plan ranked
    times = [ttt.time_to_target(c.plan, c.result.iteration_s) for c in soon.ranked]
    assert times[0] == min(times)
    assert times[0] < ttt.time_to_target(fast.best, fast.ranked[0].result.iteration_s)


@pytest.mark.slow
def test_the_published_prior_alone_keeps_a_clear_per_step_win():
    fast, soon = tune("throughput"), tune("time-to-target")
    assert soon.best.rollout == fast.best.rollout and features(fast.best.rollout) != (0.0, 0.0, 0.0)


def test_iterations_to_target_grow_with_staleness_off_policy_and_recycled_tokens():
    objective = Objective(kind="time-to-target", target_steps=200, efficiency=STALE_COSTS)
    assert features(SYNC) == (0.0, 0.0, 0.0) and objective.steps(SYNC) == 200
    assert features(ONE_OFF) == (1.0, 1.0, 0.0) and objective.steps(ONE_OFF) == pytest.approx(600)
    stale, off, share = features(ASYNC)
    assert stale == pytest.approx(1 + share) and off == 1.0 and 0 < share < 0.25
    assert objective.steps(ASYNC) > objective.steps(ONE_OFF)


def test_a_bad_objective_or_target_is_refused():
    with pytest.raises(ConfigError, match="'fastest' is not an objective; use 'throughput'.*'time-to-target'"):
        Objective(kind="fastest")
    with pytest.raises(ConfigError, match="--target-steps is 0"):
        Objective(kind="time-to-target", target_steps=0)
    with pytest.raises(ConfigError, match="'speed' is not an objective"):
        api.plan("grpo", options={"objective": "speed"}, emit=lambda s: None)


# ------------------------------------------------------------------ the plan records it


def test_the_plan_records_its_objective_and_older_plans_keep_their_ids(home):
    _, plan = api.plan(
        "grpo",
        target=_target(),
        options={"objective": "time-to-target", "target_steps": 50, "budget_s": 2},
        emit=lambda s: None,
    )
    record = plan.objective
    assert record is not None and record.kind == "time-to-target" and record.target_steps == 50
    assert record.iteration_s == pytest.approx(plan.layout.predicted.iteration_s, rel=1e-4)
    assert record.time_to_target_s == pytest.approx(record.steps * record.iteration_s, rel=1e-3)
    assert record.samples_per_s == pytest.approx(TAIL.sequences / record.iteration_s, rel=1e-3)
    assert record.efficiency == PRIOR  # nothing calibrated in this FLOWRL_HOME
    assert msgspec.structs.replace(plan, objective=None).content_id() != plan.id  # the objective is plan content
    # a plan written before objectives (no such key) keeps its id
    before = msgspec.structs.replace(plan, objective=None).sealed()
    path = dump_plan(before, home / "old.yaml")
    path.write_text("".join(line for line in path.read_text().splitlines(True) if not line.startswith("objective:")))
    assert "objective" not in path.read_text()
    old = load_plan(path)
    assert old.objective is None and old.id == before.id == old.content_id()


def _target():
    from flowrl.contract.plan import ClusterTarget

    return ClusterTarget(cluster=parse_cluster("8xH100-80G"), model=MODEL_PRESETS["qwen2.5-0.5b"], workload=TAIL)


# ------------------------------------------------------------------ calibration from reward curves


def _plan_file(folder: Path, policy: RolloutPolicy, task: str = "repeat") -> Path:
    """A run folder's plan.yaml: the tiny local plan with ``policy`` as its rollout."""
    _, plan = api.plan("grpo", overrides=[f"task={task}", "steps=4"], emit=lambda s: None)
    plan = msgspec.structs.replace(plan, layout=msgspec.structs.replace(plan.layout, rollout=policy)).sealed()
    folder.mkdir(parents=True, exist_ok=True)
    return dump_plan(plan, folder / "plan.yaml")


def _curve(tau: float, steps: int) -> list[float]:
    """A reward rising from 0 toward 1 with time constant ``tau`` steps."""
    return [1 - math.exp(-(i + 1) / tau) for i in range(steps)]


def _metrics(folder: Path, rewards: list[float], **per_step: float) -> None:
    """metrics.jsonl: ``rewards`` and the given ``<node>/<metric>`` values on every step (and a line a crash cut)."""
    lines = [json.dumps({"step": i, "reward": r, **per_step}) for i, r in enumerate(rewards)]
    (folder / "metrics.jsonl").write_text("\n".join([*lines, '{"step": 99, "rew']) + "\n")


def _run(tmp: Path, name: str, policy: RolloutPolicy, tau: float, steps: int = 80, **measured: float) -> Path:
    folder = tmp / name
    _plan_file(folder, policy)
    _metrics(folder, _curve(tau, steps), **measured)
    return folder


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> dict[str, Path]:
    """Runs whose reward curves rise 1.8x (one-step-off) and 2.5x (async + partial) slower than sync's."""
    tmp = tmp_path_factory.mktemp("curves")
    on = {"rollout/staleness_mean": 0.0, "train_actor/offpolicy_frac": 0.0, "rollout/recycled_tokens": 0.0}
    return {
        "sync": _run(tmp, "sync", SYNC, 10, **on),
        "off": _run(tmp, "off", ONE_OFF, 18, **on | {"rollout/staleness_mean": 1.0, "train_actor/offpolicy_frac": 1.0}),
        "async": _run(
            tmp,
            "async",
            ASYNC,
            25,
            **{"rollout/staleness_mean": 1.4, "train_actor/offpolicy_frac": 0.9, "rollout/recycled_tokens": 0.2},
        ),  # fmt: skip
    }


def test_calibrate_fits_the_penalties_to_the_steps_runs_took_to_the_target(synthetic):
    curves = [read_curve(synthetic[k]) for k in ("sync", "off", "async")]
    assert curves[2].features == (1.4, 0.9, 0.2) and len(curves[0].rewards) == 80  # the cut line is skipped
    fit = fit_efficiency(curves)
    assert fit.kept is None and fit.efficiency.source == "calibrated"
    assert fit.efficiency.runs == [str(synthetic[k]) for k in ("sync", "off", "async")]
    steps = {r.curve.run: r.steps for r in fit.runs}
    sync, off = steps[str(synthetic["sync"])], steps[str(synthetic["off"])]
    assert 1.6 < off / sync < 2.0  # what the curves say: about 1.8x the iterations
    for r in fit.runs:  # the fit reproduces every run's steps
        assert r.predicted == pytest.approx(r.steps, rel=0.1), r.curve.run
    e = fit.efficiency
    assert e.penalty(1.0, 1.0, 0.0) == pytest.approx(off / sync - 1, abs=0.1)
    assert e.penalty(1.0, 1.0, 0.0) > 5 * PRIOR.penalty(1.0, 1.0, 0.0)  # far more than the published prior's
    assert fit.target == pytest.approx(0.9 * sum(_curve(10, 80)[-WINDOW:]) / WINDOW, rel=0.05)


def test_a_run_that_never_reached_the_target_needs_more_steps_than_it_ran(synthetic, tmp_path):
    slow = _run(tmp_path, "slow", ASYNC, 200, steps=60)  # no metrics of staleness: the policy's nominal values
    curves = [read_curve(synthetic["sync"]), read_curve(synthetic["off"]), read_curve(slow)]
    assert curves[2].measured == () and curves[2].features == features(ASYNC)
    fit = fit_efficiency(curves)
    (censored,) = [r for r in fit.runs if r.steps is None]
    assert censored.ran == 60 and censored.predicted >= 60 * 0.97


def test_one_policy_keeps_the_prior_and_says_why(synthetic, tmp_path):
    again = _run(tmp_path, "sync2", SYNC, 12)
    fit = fit_efficiency([read_curve(synthetic["sync"]), read_curve(again)])
    assert fit.efficiency == PRIOR and "one rollout policy (sync)" in fit.kept
    flat = _run(tmp_path, "flat", ONE_OFF, 1e9)  # learns nothing
    fit = fit_efficiency([read_curve(synthetic["sync"]), read_curve(flat)], target=2.0)
    assert fit.efficiency == PRIOR and "no run reached the target reward 2" in fit.kept


def test_runs_without_rewards_or_a_plan_are_named(tmp_path):
    empty = tmp_path / "empty"
    _plan_file(empty, SYNC)
    (empty / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(ConfigError, match="run '.*empty': metrics.jsonl has no step with a reward"):
        read_curve(empty)
    with pytest.raises(ConfigError, match="run '.*nowhere': no plan.yaml"):
        read_curve(tmp_path / "nowhere")


def test_a_saved_efficiency_is_what_plans_rank_with(home):
    assert in_use() == PRIOR
    save_efficiency(STALE_COSTS)
    assert efficiency_path().is_file() and in_use() == STALE_COSTS


# ------------------------------------------------------------------ the CLI


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = cli.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture
def workload(tmp_path) -> Path:
    path = tmp_path / "tail.yaml"
    path.write_text(
        "prompts_per_step: 64\nsamples_per_prompt: 4\nprompt_length: 256\n"
        "response_length: {kind: lognormal, median: 256, sigma: 1.2, max: 4096}\n"
    )
    return path


@pytest.mark.slow
def test_explain_prints_samples_per_second_beside_time_to_target_and_why(home, workload, capsys):
    plan = ["plan", "grpo", "--cluster", "8xH100-80G", "--model", "qwen2.5-0.5b", "--workload", str(workload)]
    plan += ["--budget", "2", "--explain"]
    rc, out, _ = _cli(capsys, *plan)
    assert rc == 0
    lines = out.splitlines()
    assert any(line.startswith("objective: throughput") for line in lines)
    head = next(i for i, line in enumerate(lines) if "samples/s" in line and "to target" in line)
    row = lines[head + 1].split()
    assert float(row[1]) == pytest.approx(TAIL.sequences / float(row[0]), rel=0.01)  # samples/s = samples / s
    assert "target: 600 iterations of a sync run" in out  # the run config's steps: the default target
    assert float(row[2]) > 600  # the winner's samples are stale or recycled: more iterations, by the prior
    assert any(line.startswith("why: it is the fastest per iteration") for line in lines)
    winner = next(line for line in lines if line.startswith("winner:"))
    assert "rollout async" in winner or "partial" in winner

    save_efficiency(STALE_COSTS)  # what `flowrl calibrate` saves: plans read it
    rc, out, _ = _cli(capsys, *plan, "--objective", "time-to-target", "--target-steps", "80")
    assert rc == 0
    assert "| rollout sync | " in next(line for line in out.splitlines() if line.startswith("winner:"))
    assert "sample efficiency calibrated from a, b:" in out
    why = next(line for line in out.splitlines() if line.startswith("why: "))
    assert "80 iterations" in why or "iterations to the winner's 80" in why
    assert "on-policy" in why


def test_a_bad_objective_on_the_command_line_is_a_user_error(home, capsys):
    rc, _, err = _cli(capsys, "plan", "grpo", "--objective", "fastest")
    assert rc == 2 and "--objective 'fastest' is not an objective" in err
    rc, _, err = _cli(capsys, "plan", "grpo", "--objective", "time-to-target", "--target-steps", "0")
    assert rc == 2 and "--target-steps is 0" in err


@pytest.mark.slow
def test_calibrate_fits_sample_efficiency_from_two_real_runs(home, tmp_path, capsys):
    runs = {}
    for name, mode in (("sync", "sync"), ("off", "one_step_off")):
        argv = ["run", "grpo", "--steps", "5", "--out", str(tmp_path), "--name", name, "--quiet"]
        for s in ("task=repeat", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=2", "checkpoint=false"):
            argv += ["--set", s]
        assert cli.main([*argv, "--set", f"rollout.mode={mode}"]) == 0
        runs[name] = tmp_path / name
    measured = {}
    for name, tau in (("sync", 2.0), ("off", 4.0)):  # the real runs' metrics, with rewards of a known shape
        path = runs[name] / "metrics.jsonl"
        records = [json.loads(line) for line in path.read_text().splitlines()]
        measured[name] = records[-1]["rollout/staleness_mean"]
        rewards = _curve(tau, 40)
        extra = [{**records[-1], "step": i, "reward": rewards[i]} for i in range(len(records), 40)]
        records = [{**r, "reward": rewards[r["step"]]} for r in records] + extra
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert measured == {"sync": 0.0, "off": 1.0}  # one-step-off's samples are one version old
    rc, out, err = _cli(capsys, "calibrate", str(runs["sync"]), str(runs["off"]))
    assert rc == 0, err
    assert "sample efficiency: target reward" in out and f"sample efficiency written to {efficiency_path()}" in out
    fitted = in_use()
    assert fitted.source == "calibrated" and fitted.runs == [str(runs["sync"]), str(runs["off"])]
    assert fitted.penalty(1.0, 1.0, 0.0) > 0.4  # one-step-off took about twice the steps
    rc, out, _ = _cli(capsys, "calibrate", str(runs["sync"]))
    assert rc == 0 and "kept the prior: the runs all use one rollout policy (sync)" in out
