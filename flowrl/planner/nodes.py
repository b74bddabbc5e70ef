"""The planner's cluster from the nodes an executor discovered at ``--address`` (`flowrl run --address`
without ``--cluster``): ``nodes x devices_per_node``, the smallest node's count; a device is one GPU,
its preset named by the cluster's accelerator type, or on a cluster without GPUs one CPU of this
machine's kind (as ``--cluster cpu:N`` cuts it). Nodes that offer no device (a head that only runs the
driver) are left out. A cluster given with ``--cluster`` is checked against the nodes instead."""

from __future__ import annotations

from collections.abc import Sequence

from flowrl.contract.hardware import ClusterNode, ClusterSpec, HardwareSpec
from flowrl.errors import ConfigError
from flowrl.planner.hardware import HARDWARE_PRESETS, cpu_cluster


def usable(nodes: Sequence[ClusterNode], gpus: bool) -> list[ClusterNode]:
    """The nodes that offer at least one device of the kind (a head started with ``--num-cpus 0`` does not)."""
    return [n for n in nodes if n.devices(gpus) >= 1]


def cluster_of(nodes: Sequence[ClusterNode], machine: HardwareSpec, address: str) -> ClusterSpec:
    """The planner's cluster for ``nodes``: GPUs when any node has them (their preset named by the
    cluster's accelerator type), else CPUs (each one device of ``machine``'s CPU, as ``cpu:N`` cuts it)."""
    gpus = any(n.gpus for n in nodes)
    mine = usable(nodes, gpus)
    if not mine:
        raise ConfigError(f"the cluster at --address {address} has no node with a CPU or GPU to run workers on.")
    per_node = min(n.devices(gpus) for n in mine)
    if gpus:
        hardware = _gpu_hardware(mine, address)
        per_node = min(per_node, hardware.devices_per_node)
    else:
        hardware = cpu_cluster(machine, per_node).hardware
    return ClusterSpec(nodes=len(mine), devices_per_node=per_node, hardware=hardware)


def _gpu_hardware(nodes: Sequence[ClusterNode], address: str) -> HardwareSpec:
    kinds = sorted({n.accelerator or "?" for n in nodes})
    if len(kinds) > 1 or kinds[0] == "?":
        raise ConfigError(
            f"the cluster at --address {address} has GPUs of kinds {', '.join(kinds)} ('?': the cluster does not say); "
            "name the cluster to plan for with --cluster (e.g. --cluster 2x8xH100-80G)."
        )
    exact = {k.lower(): v for k, v in HARDWARE_PRESETS.items()}
    kind = kinds[0].lower()
    found = exact.get(kind) or next(
        (v for k, v in exact.items() if k.startswith(kind + "-") and sum(x.startswith(kind + "-") for x in exact) == 1),
        None,
    )
    if found is None:
        raise ConfigError(
            f"the cluster at --address {address} has {kinds[0]} GPUs, which match no hardware preset "
            f"({', '.join(HARDWARE_PRESETS)}); name the cluster with --cluster (a preset or a cluster file)."
        )
    return found


def check_cluster(cluster: ClusterSpec, nodes: Sequence[ClusterNode], address: str) -> None:
    """ConfigError naming what the Ray cluster lacks to be ``cluster``: nodes, or devices on a node."""
    gpus = not cluster.on_cpu
    kind = "GPU" if gpus else "CPU"
    fit = [n for n in nodes if n.devices(gpus) >= cluster.devices_per_node]
    if len(fit) >= cluster.nodes:
        return
    have = ", ".join(f"{n.node_id[:12]} {n.devices(gpus)} {kind}" for n in nodes) or "no alive node"
    raise ConfigError(
        f"--cluster {cluster.label} needs {cluster.nodes} node(s) with {cluster.devices_per_node} {kind} each; the Ray "
        f"cluster at --address {address} has {len(fit)} such node(s) ({have}): it is short of "
        f"{cluster.nodes - len(fit)} node(s) with {cluster.devices_per_node} {kind}. Drop --cluster to plan for the "
        "nodes it has."
    )


def joined_cluster(
    nodes: Sequence[ClusterNode], machine: HardwareSpec, address: str, given: ClusterSpec | None = None
) -> ClusterSpec:
    """The cluster a run that joins ``address`` plans for: ``given`` (``--cluster``) once checked against
    ``nodes``, else the nodes themselves (`cluster_of`)."""
    if given is not None:
        check_cluster(given, nodes, address)
        return given
    return cluster_of(nodes, machine, address)
