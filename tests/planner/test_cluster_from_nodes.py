"""What a Ray cluster's nodes become for the planner, without starting Ray: nodes x the smallest node's
GPUs (their preset named by Ray's accelerator type) or, without GPUs, CPUs; nodes that offer no device
(a head that only runs the driver) left out; a cluster that Ray cannot name refused, saying to pass
--cluster; a given cluster checked against the nodes, naming what is short."""

from __future__ import annotations

import pytest

from flowrl.contract import ClusterNode
from flowrl.errors import ConfigError
from flowrl.planner.hardware import HARDWARE_PRESETS, cpu_cluster, parse_cluster
from flowrl.planner.nodes import check_cluster, cluster_of

pytest.importorskip("ray")

MACHINE = cpu_cluster(HARDWARE_PRESETS["A100-80G"], 1).hardware  # any HardwareSpec stands for this machine


def node(i: int, cpus: int, gpus: int = 0, accelerator: str | None = None, head: bool = False) -> ClusterNode:
    return ClusterNode(node_id=f"{i:056x}", ip=f"10.0.0.{i}", head=head, cpus=cpus, gpus=gpus, accelerator=accelerator)


def test_gpu_nodes_become_nodes_x_gpus_of_their_preset_and_a_driver_only_head_is_left_out():
    nodes = [node(0, 0, head=True), node(1, 32, 8, "H100"), node(2, 32, 4, "H100")]
    spec = cluster_of(nodes, MACHINE, "auto")
    assert (spec.nodes, spec.devices_per_node, spec.hardware.name) == (2, 4, "H100-80G")
    assert cluster_of([node(1, 8, 8, "A100-40G")], MACHINE, "auto").hardware.name == "A100-40G"


def test_cpu_nodes_become_nodes_x_cpus_and_an_unnamed_gpu_is_refused():
    spec = cluster_of([node(0, 4, head=True), node(1, 2)], MACHINE, "auto")
    assert (spec.nodes, spec.devices_per_node, spec.on_cpu) == (2, 2, True)
    with pytest.raises(ConfigError, match="match no hardware preset.*--cluster"):
        cluster_of([node(1, 8, 8, "T4")], MACHINE, "auto")
    with pytest.raises(ConfigError, match=r"kinds \?.*--cluster"):
        cluster_of([node(1, 8, 8, None)], MACHINE, "auto")
    with pytest.raises(ConfigError, match="no node with a CPU or GPU"):
        cluster_of([node(0, 0, head=True)], MACHINE, "auto")


def test_a_given_cluster_is_checked_against_the_nodes_naming_what_is_short():
    nodes = [node(0, 0, head=True), node(1, 32, 8, "H100"), node(2, 32, 8, "H100")]
    check_cluster(parse_cluster("2x8xH100-80G"), nodes, "auto")
    with pytest.raises(ConfigError, match=r"needs 3 node\(s\) with 8 GPU each.*short of 1 node\(s\) with 8 GPU"):
        check_cluster(parse_cluster("3x8xH100-80G"), nodes, "auto")
