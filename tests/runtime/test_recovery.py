"""A run restarts by itself from its last checkpoint after a `WorkerLostError` (`flowrl.runtime.recovery`),
here on the in-process executor with its worker lost at chosen iterations (as the Ray executor reports a
killed worker: tests/ray/test_recovery.py kills real ones): every step once in metrics.jsonl, equal to an
uninterrupted run, a restart record where the run continued; no restart with max_restarts=0 or without
checkpoints; a clear stop once the restarts are used up."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from helpers import SMALL_RUN, metrics_rows, run_cli, untimed

from flowrl import api
from flowrl.errors import WorkerLostError
from flowrl.plugins.manager import registry
from flowrl.runtime.executor import PlanExecutor

STEPS = 6


class _Losing:
    """The in-process transport, whose worker is lost at the first call of each iteration in ``lose_at``."""

    def __init__(self, inner: Any, lose_at: list[int]) -> None:
        self.inner, self.lose_at = inner, lose_at
        self.iteration: int | None = None

    def call(self, ranks: Any, method: str, args: Any, tag: str) -> list[Any]:
        if self.lose_at and self.iteration == self.lose_at[0]:
            self.lose_at.pop(0)
            raise WorkerLostError(
                f"worker rank 0 (device group 'all', pid {os.getpid()}) died in iteration {self.iteration}",
                rank=0,
                pid=os.getpid(),
                group="all",
                iteration=self.iteration,
                task=tag,
            )
        return self.inner.call(ranks, method, args, tag)

    def spans(self) -> Any:
        return self.inner.spans()

    def close(self) -> None:
        self.inner.close()


class _LosesItsWorker(PlanExecutor):
    """The in-process executor, its worker lost at the iterations ``lose_at`` (once each)."""

    def __init__(self, reg: Any, lose_at: list[int]) -> None:
        super().__init__(reg)
        self.lose_at = lose_at

    def launch(self, graph: Any, plan: Any, schedule: Any, out_dir: Path) -> Any:
        transport, built = super().launch(graph, plan, schedule, out_dir)
        return _Losing(transport, self.lose_at), built


def _run(
    tmp_path: Path, name: str, lose_at: list[int], *extra: str, address: str | None = None
) -> tuple[Any, Path, list[str]]:
    overrides = [*SMALL_RUN, f"steps={STEPS}", "save_every=2", f"out={tmp_path}", f"name={name}", *extra]
    graph, plan = api.plan("grpo", overrides=overrides, emit=lambda s: None)
    ex = _LosesItsWorker(registry(), list(lose_at))
    if address is not None:  # as the Ray executor of a run that joined a cluster (`--address`)
        ex.address = address  # type: ignore[attr-defined]
    ex.check(graph, plan)
    out = tmp_path / name
    lines: list[str] = []
    try:
        result = api.run(graph, plan, executor=ex, out_dir=out, emit=lines.append)
    except WorkerLostError as exc:
        exc.lines = lines  # type: ignore[attr-defined]
        raise
    return result, out, lines


def _steps(out: Path) -> list[dict]:
    return untimed([r for r in metrics_rows(out) if r.get("kind") is None])


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    _, out, _ = _run(tmp_path_factory.mktemp("ref"), "ref", [])
    return out


@pytest.mark.slow
def test_a_lost_worker_restarts_from_the_last_checkpoint_and_the_run_equals_an_uninterrupted_one(reference, tmp_path):
    result, out, lines = _run(tmp_path, "lost", [3])
    who = f"worker rank 0 (pid {os.getpid()})"
    assert lines == [f"flowrl: {who} was lost in iteration 3; restart 1/3 from the checkpoint after step 1"]
    assert _steps(out) == _steps(reference)  # every step once, the same numbers
    order = [(r.get("kind"), r["step"]) for r in metrics_rows(out)]
    assert order == [(None, 0), (None, 1), ("restart", 2), *((None, s) for s in range(2, STEPS))]
    (restart,) = result.restarts
    assert restart["restart"]["count"] == 1 and restart["restart"]["checkpoint_step"] == 1
    assert restart["restart"]["iteration"] == 3 and not restart["restart"]["replanned"]
    assert [r["step"] for r in result.metrics] == list(range(STEPS))
    assert (out / "metrics.before-resume-1.jsonl").is_file()  # the dropped rows are kept beside it


@pytest.mark.slow
def test_a_worker_lost_before_the_first_checkpoint_restarts_at_step_0(reference, tmp_path):
    result, out, lines = _run(tmp_path, "early", [1])
    assert "from step 0 (no checkpoint yet)" in lines[0]
    assert _steps(out) == _steps(reference)
    assert [(r.get("kind"), r["step"]) for r in metrics_rows(out)][:2] == [("restart", 0), (None, 0)]


def test_the_summary_says_a_worker_lost_during_setup_so():
    from flowrl.cli import restart_line

    info = {"count": 1, "rank": 1, "iteration": None, "replanned": False}
    assert (
        restart_line({"step": 0, "restart": info}) == "restart 1: worker rank 1 lost during setup; continued at step 0"
    )
    info = {**info, "iteration": 7, "replanned": True}
    assert restart_line({"step": 6, "restart": info}).endswith("lost in iteration 7; re-planned, continued at step 6")


@pytest.mark.slow
def test_two_losses_keep_both_restartmetrics_rows(reference, tmp_path):
    result, out, lines = _run(tmp_path, "twice", [3, 5])
    assert len(result.restarts) == 2 and "restart 2/3 from the checkpoint after step 3" in lines[1]
    assert _steps(out) == _steps(reference)
    restarts = [r["step"] for r in metrics_rows(out) if r.get("kind") == "restart"]
    assert restarts == [2, 4]


def test_max_restarts_0_stops_as_before(tmp_path):
    with pytest.raises(WorkerLostError) as info:
        _run(tmp_path, "zero", [3], "max_restarts=0")
    assert info.value.lines == []  # type: ignore[attr-defined]
    assert "died in iteration 3" in str(info.value)
    assert f"flowrl run --resume {tmp_path / 'zero'}" in str(info.value)  # it got further: how to continue


def test_the_resume_command_of_a_run_that_joined_a_cluster_joins_it_again(tmp_path):
    with pytest.raises(WorkerLostError) as info:
        _run(tmp_path, "joined", [3], "max_restarts=0", address="10.0.0.1:6379")
    # without --address the resumed run would start a private Ray on this machine instead of the cluster
    assert f"flowrl run --resume {tmp_path / 'joined'} --address 10.0.0.1:6379" in str(info.value)


def test_a_run_without_checkpoints_does_not_restart(tmp_path):
    with pytest.raises(WorkerLostError, match="keeps no checkpoint"):
        _run(tmp_path, "nockpt", [3], "checkpoint=false")


def test_used_up_restarts_stop_with_the_resume_command(tmp_path):
    with pytest.raises(WorkerLostError) as info:
        _run(tmp_path, "used", [3, 2], "max_restarts=1")
    msg = str(info.value)
    assert "gave up after 1 restart(s) (--max-restarts 1)" in msg
    assert f"flowrl run --resume {tmp_path / 'used'}" in msg and msg.count("--resume") == 1


def test_replanning_a_plan_for_cpu_nodes_keeps_their_shape_so_the_nodes_left_can_hold_it(monkeypatch):
    """A run that joined a cluster of three one-CPU nodes and lost one goes on with two one-CPU nodes."""
    import msgspec

    from flowrl.contract import ClusterNode
    from flowrl.planner.nodes import cluster_of

    pytest.importorskip("ray")
    from flowrl_ray.nodes import assign

    monkeypatch.setenv("FLOWRL_PLUGINS", "ray")

    def node(i: int) -> ClusterNode:
        return ClusterNode(node_id=f"{i:056x}", ip=f"10.0.0.{i}", head=i == 0, cpus=1 if i else 0, gpus=0)

    overrides = [*SMALL_RUN, "device=cpu", "backend=ray"]
    _, cfg = api.load("grpo", overrides=overrides)
    reg = registry()
    spec = cluster_of([node(i) for i in range(4)], api.local_target(cfg, reg).cluster.hardware, "auto")
    target = msgspec.structs.replace(api.local_target(cfg, reg), cluster=spec)
    graph, plan = api.plan("grpo", overrides=overrides, target=target, for_backend=True, emit=lambda s: None)
    assert (plan.target.cluster.nodes, plan.target.cluster.devices_per_node) == (3, 1)
    new = api.replan(graph, plan, 2, reg)
    assert (new.target.cluster.nodes, new.target.cluster.devices_per_node) == (2, 1)
    left = [node(1), node(3)]
    assert assign(new, new.target.cluster.devices, left, private=False) == left  # one rank on each node left


@pytest.mark.slow
def test_the_recovery_flags_are_run_settings_recorded_in_the_plan(tmp_path, capsys):
    from flowrl.contract.plan import load_plan

    sets = [a for s in SMALL_RUN for a in ("--set", s)]
    argv = ["run", "grpo", "--steps", "1", "--quiet", "--out", str(tmp_path), *sets]
    code, _, err = run_cli(capsys, *argv, "--max-restarts", "5", "--replan-on-loss", "--device-wait", "7")
    assert code == 0, err
    plan = load_plan(tmp_path / "grpo" / "plan.yaml")
    cfg = plan.config
    assert (cfg.max_restarts, cfg.replan_on_loss, cfg.device_wait_s) == (5, True, 7.0)
    code, _, err = run_cli(capsys, "run", "--resume", str(tmp_path / "grpo"), "--max-restarts", "0")
    assert code == 0, err  # a run setting: it may change on --resume
    resumed = load_plan(tmp_path / "grpo" / "plan.yaml")
    assert resumed.config.max_restarts == 0 and resumed.id == plan.id
    code, _, err = run_cli(capsys, *argv, "--name", "bad", "--max-restarts", "-1")
    assert code == 2 and "max_restarts" in err
