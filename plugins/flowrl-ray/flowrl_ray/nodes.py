"""The nodes of a Ray cluster as the planner and the executor see them.

Discovery (`discover`): the alive nodes of the cluster at ``--address``, each with its CPU and GPU
counts (`flowrl.contract.ClusterNode`), which the planner turns into its cluster
(`flowrl.planner.nodes`).

Placement (`plan_nodes`, `assign`, `check_tp_inside_nodes`): device ``i`` of a plan lives on plan node
``i // devices_per_node``; plan node ``k`` is the ``k``-th Ray node in a fixed order, the head first and
then by node id (a private Ray on this machine is one node that holds them all). The executor pins each
rank's actor there; tensor-parallel ranks of one model copy must share a node, and a plan that splits
them is refused naming the model and the group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from flowrl.contract import BackendError, PlanError
from flowrl.contract.hardware import ClusterNode
from flowrl.contract.layout import tp_inside_nodes

if TYPE_CHECKING:
    from flowrl.contract import ExecutionPlan

#: The resource Ray gives the head node only.
HEAD_RESOURCE = "node:__internal_head__"


def alive_nodes() -> list[ClusterNode]:
    """The connected cluster's alive nodes: the head first, then by node id (the order plan nodes map to)."""
    import ray

    found = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        res = n.get("Resources", {})
        accel = next((k.split(":", 1)[1] for k in res if k.startswith("accelerator_type:")), None)
        found.append(
            ClusterNode(
                node_id=n["NodeID"],
                ip=n["NodeManagerAddress"],
                head=HEAD_RESOURCE in res,
                cpus=int(res.get("CPU", 0)),
                gpus=int(res.get("GPU", 0)),
                accelerator=accel,
            )
        )
    return sorted(found, key=lambda n: (not n.head, n.node_id))


def discover(address: str) -> list[ClusterNode]:
    """The alive nodes of the cluster at ``address`` (joined for the look-up, then left, unless this
    process is connected already)."""
    import ray

    if ray.is_initialized():
        return alive_nodes()
    from flowrl_ray.executor import join

    join(address)
    try:
        return alive_nodes()
    finally:
        ray.shutdown()


# ------------------------------------------------------------------ placement


def plan_nodes(plan: ExecutionPlan, world: int) -> list[int]:
    """The plan node of every rank: device ``i`` lives on node ``i // devices_per_node``."""
    per_node = plan.target.cluster.devices_per_node
    return [rank // per_node for rank in range(world)]


def check_tp_inside_nodes(plan: ExecutionPlan) -> None:
    """PlanError naming the model and device group whose tensor-parallel ranks (``tp`` consecutive ranks of
    its group, one model copy) span two nodes: tp runs inside a node, data and pipeline parallelism across."""
    layout = plan.layout
    if layout is None:
        return
    per_node = plan.target.cluster.devices_per_node
    groups = {g.name: g for g in layout.groups}
    splits = [(m.model, m.group, m.parallel.tp, "training") for m in layout.models]
    splits += [(g.model or "policy", g.group, g.tp, "generation") for g in (*layout.generations, layout.generation)]
    for model, group, tp, what in splits:
        g = groups.get(group)
        if g is None or tp <= 1 or tp_inside_nodes(g.first, g.devices, tp, per_node):
            continue
        for start in range(g.first, g.first + g.devices, tp):
            nodes = {d // per_node for d in range(start, min(start + tp, g.first + g.devices))}
            if len(nodes) > 1:
                raise PlanError(
                    f"the plan splits model '{model}' ({what}, tp {tp}) in device group '{g.name}' across nodes "
                    f"{sorted(nodes)} (devices {start}..{start + tp - 1}, {per_node} per node): tensor parallelism "
                    "runs inside a node. Plan again with the group aligned to whole nodes or a smaller tp."
                )


def assign(plan: ExecutionPlan, world: int, nodes: Sequence[ClusterNode], private: bool) -> list[ClusterNode]:
    """The Ray node of every rank. A private Ray is one node that holds every rank; a joined cluster's
    plan node ``k`` is its ``k``-th node able to hold ``devices_per_node`` devices (head first, then by
    id). BackendError naming what is short when there are too few."""
    gpus = not plan.target.cluster.on_cpu
    where = plan_nodes(plan, world)
    if private:
        return [nodes[0]] * world
    per_node = plan.target.cluster.devices_per_node
    used = max(where) + 1 if where else 0
    need = {k: where.count(k) for k in range(used)}
    fit = [n for n in nodes if n.devices(gpus) >= 1]
    kind = "GPU" if gpus else "CPU"
    if len(fit) < used or any(fit[k].devices(gpus) < need[k] for k in range(used)):
        have = ", ".join(n.describe() for n in nodes) or "no alive node"
        raise BackendError(
            f"the plan places {world} ranks on {used} node(s) of {per_node} {kind} (cluster "
            f"{plan.target.cluster.label}); the Ray cluster has {have}. Plan for the cluster you have "
            "(`flowrl run --address ...` without --cluster plans for its nodes)."
        )
    return [fit[k] for k in where]


def threads_per_rank(ranks: Sequence[ClusterNode]) -> int:
    """Compute threads for each rank: its node's CPUs shared by the ranks placed there (the fewest over nodes)."""
    count: dict[str, int] = {}
    for n in ranks:
        count[n.node_id] = count.get(n.node_id, 0) + 1
    return max(1, min((n.cpus // count[n.node_id] for n in ranks), default=1))


def node_table(ranks: Sequence[ClusterNode], where: Sequence[int]) -> list[dict[str, Any]]:
    """Per rank, its plan node and the Ray node it was placed on (for workers.json)."""
    return [{"node": k, "node_id": n.node_id, "node_ip": n.ip} for k, n in zip(where, ranks)]
