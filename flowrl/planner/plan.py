"""The ExecutionPlan: a frozen msgspec struct, JSON/YAML round-trippable, content-hashed.

Besides the graph, it is the only thing an executor receives.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgspec

from flowrl.errors import ConfigError
from flowrl.planner.hardware import ClusterSpec
from flowrl.planner.modelspec import ModelSpec
from flowrl.planner.space import ClusterPlan
from flowrl.planner.workload import WorkloadSpec
from flowrl.specs import RunConfig, convert, read_document


class _Plan(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class GraphRef(_Plan):
    """Which graph this plan is for: a file path or a registered algorithm name."""

    name: str
    source: str
    fingerprint: str


class Device(_Plan):
    name: str  # "cpu", "cuda:0"
    memory_bytes: int  # what the plan may use
    threads: int | None = None


class ModelPlacement(_Plan):
    model: str
    device: str
    dtype: str
    parameters: int
    trainable: bool
    state_bytes: int  # weights (+ grads + AdamW moments when trainable)


class NodePlan(_Plan):
    node: str
    kind: str
    device: str | None  # None: runs on the driver (reward / compute)
    rows: int  # sequences per step this node sees
    micro_batch_size: int


class MemoryEstimate(_Plan):
    device: str
    capacity_bytes: int
    required_bytes: int
    breakdown: dict[str, int]


class ClusterTarget(_Plan):
    """What a cluster plan is for: the cluster, the model every role uses, the workload."""

    cluster: ClusterSpec
    model: ModelSpec
    workload: WorkloadSpec


class ExecutionPlan(_Plan, kw_only=True):
    id: str = ""
    graph: GraphRef
    backend: str = "local"
    config: RunConfig
    devices: tuple[Device, ...] = ()
    models: tuple[ModelPlacement, ...] = ()
    nodes: tuple[NodePlan, ...] = ()
    memory: tuple[MemoryEstimate, ...] = ()
    passes: tuple[str, ...] = ()
    target: ClusterTarget | None = None  # set: plan for a cluster (autotune) instead of this machine
    cluster: ClusterPlan | None = None

    def content_id(self) -> str:
        body = msgspec.json.encode(msgspec.structs.replace(self, id=""), order="sorted")
        return hashlib.sha256(body).hexdigest()[:16]

    def sealed(self) -> ExecutionPlan:
        """This plan with ``id`` set to its content hash."""
        return msgspec.structs.replace(self, id=self.content_id())

    def node(self, name: str) -> NodePlan:
        for n in self.nodes:
            if n.node == name:
                return n
        raise KeyError(name)


def dump_plan(plan: ExecutionPlan, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix in (".yaml", ".yml"):
        path.write_bytes(msgspec.yaml.encode(plan))
    elif path.suffix == ".json":
        path.write_bytes(msgspec.json.format(msgspec.json.encode(plan)))
    else:
        raise ConfigError(f"plan file '{path}': use a .yaml or .json name.")
    return path


def encode_plan(plan: ExecutionPlan, fmt: str = "yaml") -> str:
    if fmt == "json":
        return msgspec.json.format(msgspec.json.encode(plan)).decode()
    return msgspec.yaml.encode(plan).decode()


def load_plan(path: str | Path) -> ExecutionPlan:
    """Read a plan file; a plan whose content no longer matches its id is refused."""
    plan = convert(read_document(path), ExecutionPlan, f"plan file '{path}'")
    if plan.id and plan.id != plan.content_id():
        raise ConfigError(f"plan file '{path}' was edited after it was planned (id {plan.id} != content {plan.content_id()}). Re-run `flowrl plan`, or delete the 'id' line to accept the edit.")
    return plan.sealed()
