"""Several Ray nodes: a run that joins a cluster (``--address``) plans for its nodes, places one rank per
node as the plan says (workers.json names each rank's node), learns across them, refuses a run folder
its workers cannot see, and a kill -9 of the driver followed by ``--resume`` on the same cluster equals
the uninterrupted run, metrics and final weights, while the killed driver's workers do not linger.

One local multi-node Ray cluster serves the module (`ray.cluster_utils.Cluster`, as Ray's own tests
start one: a head and a second node with their own raylets, one CPU each, and a custom resource that
names each node); it is shut down at the end (never `ray stop`). This process stays connected to it;
in-process runs join that connection, CLI runs join with ``--address``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from statistics import mean

import pytest
from helpers import ONE_LAYER, metrics_rows, untimed
from safetensors.torch import load_file

from flowrl import api
from flowrl.errors import BackendError, ConfigError, PlanError
from flowrl.plugins.manager import registry
from flowrl.runtime import checkpoint

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow  # a two-node Ray cluster, runs across it

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes on this machine: the head (1 CPU, resource ``node_a``) and a worker node (1 CPU,
    ``node_b``); this process connected to them, the Ray plugin enabled."""
    from ray.cluster_utils import Cluster

    env = {"FLOWRL_PLUGINS": "ray", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "resources": {"node_a": 1}, "include_dashboard": False},
    )
    try:
        c.add_node(num_cpus=1, resources={"node_b": 1})
        c.wait_for_nodes()
        ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def named_nodes() -> dict[str, str]:
    """Ray node id -> the custom resource that names it (node_a, node_b)."""
    return {
        n["NodeID"]: next(k for k in n["Resources"] if k.startswith("node_") and k != "node_")
        for n in ray.nodes()
        if n["Alive"]
    }


def discovered(cfg, address, given):
    """The cluster `flowrl run --address ADDRESS [--cluster GIVEN]` plans for."""
    from flowrl.planner.nodes import joined_cluster
    from flowrl_ray.executor import machine, nodes

    return joined_cluster(nodes(address), machine(cfg), address, given)


def joined_plan(graph: str, out: Path, *extra: str, **options):
    """``graph`` planned for the cluster's nodes, as `flowrl run --address` plans it."""
    import msgspec

    overrides = ["progress=false", "backend=ray", "device=cpu", f"out={out}", *extra]
    _, cfg = api.load(graph, overrides=overrides)
    spec = discovered(cfg, "auto", None)  # this process is connected: the cluster it is connected to
    target = msgspec.structs.replace(api.local_target(cfg, registry()), cluster=spec)
    return api.plan(graph, overrides=overrides, target=target, for_backend=True, options=options, emit=lambda s: None)


def test_the_cluster_nodes_become_the_plan_cluster_and_a_larger_cluster_is_refused_naming_the_shortfall(
    cluster, tmp_path
):
    from flowrl_ray import nodes

    found = nodes.alive_nodes()
    assert [named_nodes()[n.node_id] for n in found] == ["node_a", "node_b"]  # the head first
    assert found[0].head and not found[1].head and all(n.cpus == 1 for n in found)
    _, cfg = api.load("grpo", overrides=["device=cpu"])
    spec = discovered(cfg, cluster.address, None)
    assert (spec.nodes, spec.devices_per_node, spec.on_cpu) == (2, 1, True)
    # `--cluster cpu:2` is one node of two CPUs: this cluster has two nodes of one
    from flowrl.planner.hardware import cpu_cluster

    one_node = cpu_cluster(spec.hardware, 2)
    with pytest.raises(ConfigError, match=r"needs 1 node\(s\) with 2 CPU each.*short of 1 node\(s\) with 2 CPU"):
        discovered(cfg, cluster.address, one_node)
    assert discovered(cfg, cluster.address, spec) is spec  # what it has passes
    # a plan made for one two-CPU node is refused before a worker starts
    target = api.local_target(cfg, registry(), devices=2)
    overrides = ["device=cpu", "backend=ray", "rollout.prompts_per_step=4", "progress=false", f"out={tmp_path}"]
    g, plan = api.plan("grpo", overrides=overrides, target=target, for_backend=True, emit=lambda s: None)
    with pytest.raises(BackendError, match=r"on 1 node\(s\) of 2 CPU"):
        api.run(g, plan, out_dir=tmp_path / "refused")
    assert ray.available_resources().get("CPU") == 2  # nothing was left placed


def test_a_plan_that_splits_tensor_parallel_ranks_across_nodes_is_refused_by_name(cluster, tmp_path):
    import msgspec

    from flowrl_ray import nodes

    g, plan = joined_plan("grpo", tmp_path, "rollout.prompts_per_step=4", placement="colocate")
    nodes.check_tp_inside_nodes(plan)  # what the planner made keeps tp (1 here) inside a node
    # the same plan with the actor trained tp 2 over the group's two devices: one on each node
    layout = plan.layout
    models = tuple(
        msgspec.structs.replace(m, parallel=msgspec.structs.replace(m.parallel, dp=1, tp=2)) for m in layout.models
    )
    split = msgspec.structs.replace(plan, layout=msgspec.structs.replace(layout, models=models))
    with pytest.raises(PlanError, match=r"splits model 'actor' \(training, tp 2\) in device group 'all' across nodes"):
        nodes.check_tp_inside_nodes(split)


def test_a_dp2_plan_with_one_rank_per_node_learns(cluster, tmp_path):
    extra = ["steps=35", "seed=0", "task=repeat", "checkpoint=false", ONE_LAYER]
    g, plan = joined_plan("grpo", tmp_path, *extra, placement="colocate")
    (actor,) = [m for m in plan.layout.models if m.model == "actor"]
    assert actor.parallel.dp == 2 and plan.target.cluster.nodes == 2
    result = api.run(g, plan)
    workers = json.loads((result.out_dir / "workers.json").read_text())
    names = named_nodes()
    assert [(w["rank"], w["node"], names[w["node_id"]]) for w in workers] == [(0, 0, "node_a"), (1, 1, "node_b")]
    rewards = [m["reward"] for m in result.metrics]
    first, last = mean(rewards[:10]), mean(rewards[-10:])
    print(f"GRPO repeat, dp=2 over two Ray nodes: reward {first:.3f} -> {last:.3f}")
    assert first < 0.2 and last > 0.35, rewards


def _unshare_works() -> bool:
    try:
        return subprocess.run(["unshare", "-m", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def flowrl(*args: str) -> list[str]:
    return [sys.executable, "-m", "flowrl", *args]


@pytest.mark.skipif(not _unshare_works(), reason="needs `unshare -m` (a private mount namespace) for the driver")
def test_a_run_folder_the_workers_cannot_see_is_refused_before_training(cluster, tmp_path):
    # the driver runs in a mount namespace of its own with a private file system over its run folder, as on
    # a machine whose local disk the other nodes do not mount
    private = tmp_path / "private"
    private.mkdir()
    run = flowrl("run", "grpo", "--address", cluster.address, "--steps", "2", "--out", str(private), "--quiet")
    script = f"mount -t tmpfs flowrl-private {private} && exec {' '.join(run)}"
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    said = " ".join(proc.stderr.split())  # the CLI wraps its message
    assert "is not shared with worker rank 0 on head node" in said and "ReadWriteMany volume" in said, said
    _no_workers_left()


def _no_workers_left(pids: list[int] = ()) -> None:
    """The cluster's CPUs are all free again and ``pids`` are gone (a killed driver's job is cleaned up by
    Ray's control store; give it up to a minute)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        if ray.available_resources().get("CPU") == 2 and not alive:
            return
        time.sleep(0.5)
    raise AssertionError(f"workers linger: CPUs free {ray.available_resources().get('CPU')}, pids alive {alive}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _stripped(folder: Path) -> list[dict]:
    return untimed(metrics_rows(folder))


def test_kill_9_of_the_driver_then_resume_on_the_cluster_equals_the_uninterrupted_run(cluster, tmp_path):
    steps = 6
    sizes = ["--set", "rollout.prompts_per_step=4", "--set", ONE_LAYER]
    plan_file = tmp_path / "plan.yaml"
    made = subprocess.run(
        flowrl("plan", "grpo", "--address", cluster.address, "--placement", "colocate", "--set", f"steps={steps}",
               "--set", "save_every=1", *sizes, "--out", str(plan_file)),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    # the uninterrupted run, in this process (joined to the same cluster)
    from flowrl.contract.plan import load_plan

    plan = load_plan(str(plan_file))
    assert plan.target.cluster.nodes == 2 and plan.layout.models[0].parallel.dp == 2
    g = api.graph_for_plan(plan)
    ref = api.run(g, plan, out_dir=tmp_path / "ref")
    # the same plan from the CLI, killed with -9 after its second checkpoint, then resumed
    folder = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        flowrl("run", "--plan", str(plan_file), "--address", cluster.address, "--out", str(tmp_path), "--name", "run",
               "--quiet"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    while proc.poll() is None and len(checkpoint.listed(folder)) < 2:
        time.sleep(0.01)
    assert proc.poll() is None, proc.communicate()[1]  # killed mid-run
    workers = json.loads((folder / "workers.json").read_text())
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert len(_stripped(folder)) < steps
    assert sorted(named_nodes()[w["node_id"]] for w in workers) == ["node_a", "node_b"]
    _no_workers_left([w["pid"] for w in workers])  # Ray ends a dead driver's actors and placement groups
    done = subprocess.run(
        flowrl("run", "--resume", str(folder), "--address", cluster.address, "--quiet"),
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert "resumed from the checkpoint after step" in done.stdout, done.stdout
    a, b = _stripped(ref.out_dir), _stripped(folder)
    assert [r["step"] for r in b] == list(range(steps))
    assert a == b
    for name, tensor in load_file(str(ref.out_dir / "checkpoint" / "model.safetensors")).items():
        other = load_file(str(folder / "checkpoint" / "model.safetensors"))[name]
        assert tensor.equal(other), name


def test_an_address_where_no_ray_cluster_listens_is_refused_at_once_naming_it():
    import socket

    from flowrl_ray.executor import join

    with socket.socket() as s:  # a port on this machine that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"127.0.0.1:{port}"
    with pytest.raises(BackendError, match=rf"no Ray cluster at --address {address} \(nothing answers"):
        join(address)  # Ray itself retries for minutes
