"""A worker process or a whole node lost mid-run: the run restarts from its last checkpoint by itself.

One local multi-node Ray cluster for the module (`ray.cluster_utils.Cluster`: a head with no CPU, two
nodes of one CPU each: a plan for its nodes puts one rank on each, as `flowrl run --address` plans). A worker is
killed by its pid (from workers.json), a node is removed with ``Cluster.remove_node``; the run goes on
with a replacement node, re-planned for the node left (``replan_on_loss``), or stops with a message that
says what is missing and how to resume. Never ``ray stop``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from helpers import metrics_rows, untimed

from flowrl import api
from flowrl.errors import WorkerLostError
from flowrl.plugins.manager import registry

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")
psutil = pytest.importorskip("psutil")

pytestmark = pytest.mark.slow  # a local Ray cluster, workers and nodes killed mid-run

STEPS = 6


@pytest.fixture(scope="module")
def cluster():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    c = cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(2):
        c.add_node(num_cpus=1)
    c.wait_for_nodes()
    ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()  # removes its nodes only


@pytest.fixture
def two_nodes(cluster, monkeypatch):
    """Two live one-CPU nodes before each test (a test may have removed one, or crashed one, which stays in
    Ray's node table until its heartbeats time out)."""
    monkeypatch.setenv("FLOWRL_PLUGINS", "ray")
    while len(cluster.worker_nodes) < 2:
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    deadline = time.monotonic() + 120
    while sum(n["Alive"] for n in ray.nodes()) > len(cluster.worker_nodes) + 1 and time.monotonic() < deadline:
        time.sleep(0.5)
    return cluster


def _plan(tmp_path: Path, *extra: str):
    overrides = [
        "rollout.prompts_per_step=4",
        "rollout.samples_per_prompt=4",
        f"steps={STEPS}",
        "save_every=2",
        "backend=ray",
        "device=cpu",
        "progress=false",
        f"out={tmp_path}",
        *extra,
    ]
    import msgspec

    from flowrl.planner.nodes import joined_cluster
    from flowrl_ray.executor import machine, nodes

    _, cfg = api.load("grpo", overrides=overrides)
    spec = joined_cluster(nodes("auto"), machine(cfg), "auto")  # the cluster's nodes, as `--address` plans
    assert (spec.nodes, spec.devices_per_node) == (2, 1)
    target = msgspec.structs.replace(api.local_target(cfg, registry()), cluster=spec)
    return api.plan(
        "grpo",
        overrides=overrides,
        target=target,
        for_backend=True,
        options={"placement": "colocate"},
        emit=lambda s: None,
    )


def _steps(folder: Path) -> list[dict]:
    return untimed([r for r in metrics_rows(folder) if r.get("kind") is None])


def _worker(folder: Path, rank: int) -> dict:
    return json.loads((folder / "workers.json").read_text())[rank]


def _node_of(cluster, pid: int):
    """The cluster node whose raylet started the worker process ``pid``."""
    parents = {p.pid for p in psutil.Process(pid).parents()}
    for node in cluster.worker_nodes:
        raylets = node.all_processes.get(ray._private.ray_constants.PROCESS_TYPE_RAYLET, [])
        if any(info.process.pid in parents for info in raylets):
            return node
    raise AssertionError(f"no node of the cluster started worker pid {pid}")


def _run(tmp_path: Path, name: str, on_step=None, *extra: str, lines: list[str] | None = None):
    graph, plan = _plan(tmp_path, *extra)
    out = tmp_path / name
    out.mkdir()
    said = lines if lines is not None else []
    result = api.run(graph, plan, out_dir=out, on_step=on_step, emit=said.append)
    return result, out


def test_lost_workers_and_a_node_restart_the_run_until_its_restarts_run_out_and_resumed_it_equals_an_unbroken_one(
    two_nodes, tmp_path
):
    """One run (``max_restarts=2``) loses a worker process (SIGKILL, in step 2): it restarts from the checkpoint
    after step 1; then a whole node (removed in step 4, a replacement node added): it restarts from the
    checkpoint after step 3; then a worker again (in step 4 once more): its restarts are spent and it stops,
    saying how to resume. Resumed so, it ends as the uninterrupted run does. (One run for the three: a run's
    cost here is its workers' start, not its steps.)"""
    reference, ref_out = _run(tmp_path, "ref")
    assert reference.restarts == []
    killed: list[int] = []
    lost: dict = {}
    lines: list[str] = []

    def kill_rank_1():
        killed.append(_worker(out, 1)["pid"])
        threading.Timer(0.05, os.kill, (killed[-1], signal.SIGKILL)).start()

    def on_step(record):
        if record["step"] == 2 and not killed:  # a moment into step 3; the checkpoint is after step 1
            kill_rank_1()
        elif record["step"] == 4 and not lost:  # the restarted run, a moment into step 5; checkpoint after step 3
            worker = _worker(out, 1)
            assert worker["pid"] != killed[0]  # the restart started a new rank 1
            node = _node_of(two_nodes, worker["pid"])
            lost.update(worker)
            threading.Timer(0.05, two_nodes.remove_node, (node,)).start()
            two_nodes.add_node(num_cpus=1)  # its replacement (from this thread: Ray sets signal handlers)
        elif record["step"] == 4 and len(killed) == 1:  # step 4 once more, after the second restart
            kill_rank_1()

    out = tmp_path / "killed"
    graph, plan = _plan(tmp_path, "max_restarts=2")
    out.mkdir()
    with pytest.raises(WorkerLostError) as info:
        api.run(graph, plan, out_dir=out, on_step=on_step, emit=lines.append)
    first, second = lines
    assert f"worker rank 1 (pid {killed[0]}) was lost in iteration 3" in first
    assert "restart 1/2 from the checkpoint after step 1" in first
    assert "restart 2/2 from the checkpoint after step 3" in second and "re-planned" not in second
    msg = str(info.value)
    assert len(killed) == 2
    assert f"pid {killed[1]}" in msg and "gave up after 2 restart(s) (--max-restarts 2)" in msg
    assert f"flowrl run --resume {out}" in msg
    restarts = [r for r in metrics_rows(out) if r.get("kind") == "restart"]
    assert [r["step"] for r in restarts] == [2, 4]
    assert restarts[0]["restart"]["rank"] == 1 and restarts[0]["restart"]["pid"] == killed[0]
    assert restarts[1]["restart"]["rank"] == 1 and restarts[1]["restart"]["pid"] == lost["pid"]
    order = [(r.get("kind"), r["step"]) for r in metrics_rows(out)]  # each restart record where the run continued
    restarted = [("restart", 2), (None, 2), (None, 3), ("restart", 4), (None, 4)]
    assert order == [(None, 0), (None, 1), *restarted]  # what finished; the checkpoint after step 3 resumes

    api.run(graph, plan, out_dir=out, resume=True, emit=lines.append)
    steps = _steps(out)
    assert [r["step"] for r in steps] == list(range(STEPS))  # every step once, in order
    ref_steps = _steps(ref_out)
    differ = sorted({k for a, b in zip(steps, ref_steps) for k in a.keys() | b.keys() if a.get(k) != b.get(k)})
    assert steps == ref_steps, differ  # the same numbers as the uninterrupted run
    from safetensors.torch import load_file

    mine = load_file(str(out / "checkpoint" / "model.safetensors"))
    ref = load_file(str(ref_out / "checkpoint" / "model.safetensors"))
    assert mine.keys() == ref.keys() and all(bool((mine[k] == ref[k]).all()) for k in ref)
    assert ray.is_initialized()  # the joined cluster stays


def test_a_crashed_node_without_replacement_stops_with_what_is_missing_and_the_resume_command(two_nodes, tmp_path):
    def on_step(record):
        if record["step"] == 2:
            pid = _worker(out, 1)["pid"]
            node = _node_of(two_nodes, pid)
            # a crash (its raylet SIGKILLed): Ray lists the node as alive until its heartbeats time out, and a
            # restart must not place a rank there meanwhile (a placement that never comes). Done before the
            # next step, and the rank's process gone, so the run cannot finish first on a slow box.
            two_nodes.remove_node(node, allow_graceful=False)
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()
            psutil.wait_procs([p for p in psutil.process_iter() if p.pid == pid], timeout=30)

    out = tmp_path / "short"
    graph, plan = _plan(tmp_path, "device_wait_s=1")
    out.mkdir()
    with pytest.raises(WorkerLostError) as info:
        api.run(graph, plan, out_dir=out, on_step=on_step, emit=lambda s: None)
    msg = str(info.value)
    assert "worker rank 1" in msg
    assert "the cluster has 1 CPU device(s) of the 2 the plan needs after waiting 1 s" in msg
    assert f"flowrl run --resume {out}" in msg and "--replan-on-loss" in msg
    assert [r["step"] for r in _steps(out)][:2] == [0, 1]


def test_a_lost_node_with_replan_on_loss_goes_on_with_the_devices_left(two_nodes, tmp_path):
    removed: list = []

    def on_step(record):
        if record["step"] == 2 and not removed:  # once: the re-planned run has one rank
            removed.append(_node_of(two_nodes, _worker(out, 1)["pid"]))
            threading.Timer(0.05, two_nodes.remove_node, (removed[0],)).start()

    out = tmp_path / "replan"
    graph, plan = _plan(tmp_path, "device_wait_s=1", "replan_on_loss=true")
    out.mkdir()
    lines: list[str] = []
    result = api.run(graph, plan, out_dir=out, on_step=on_step, emit=lines.append)
    assert len(result.restarts) == 1 and result.restarts[0]["restart"]["replanned"]
    assert "re-planned for the 1 device(s) left" in lines[0]
    assert [r["step"] for r in _steps(out)] == list(range(STEPS))
    from flowrl.contract.plan import load_plan

    assert load_plan(out / "plan.yaml").target.cluster.devices == 1  # a later --resume runs the new plan
