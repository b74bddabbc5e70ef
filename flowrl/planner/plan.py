"""The ExecutionPlan: a frozen msgspec struct, JSON/YAML round-trippable, content-hashed.

Besides the graph, it is the only thing an executor receives.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgspec

from flowrl.errors import ConfigError
from flowrl.planner.capabilities import Capabilities
from flowrl.planner.hardware import ClusterSpec
from flowrl.planner.memory import Numerics
from flowrl.planner.modelspec import ModelSpec
from flowrl.planner.space import ClusterPlan
from flowrl.planner.workload import WorkloadSpec
from flowrl.specs import RunConfig, Spec, convert, read_document


class GraphRef(Spec):
    """Which graph this plan is for: a file path or a registered algorithm name."""

    name: str
    source: str
    fingerprint: str


class ClusterTarget(Spec):
    """What a plan is for: the cluster (``local`` is one device of this machine), the base model
    every role uses unless ``models`` names another for it, the workload (None: derived from the
    run config by ``resolve``), how the backend holds models in memory, and what its executor can
    run (None: a forecast for any).

    ``models``: per-role models (``--model actor=llama-34b,reward=llama-7b``), keyed by role or
    graph model name as given; ``resolve`` turns the keys into every graph model's name."""

    cluster: ClusterSpec
    model: ModelSpec
    workload: WorkloadSpec | None = None
    numerics: Numerics = Numerics()
    capabilities: Capabilities | None = None
    models: dict[str, ModelSpec] = {}

    def spec(self, model: str | None) -> ModelSpec:
        """The shape of graph model ``model`` (the base model unless ``models`` names another)."""
        return self.models.get(model or "", self.model)


class NodePlan(Spec):
    node: str
    kind: str
    group: str | None  # None: runs on the driver (reward / compute)
    rows: int  # sequences per step this node sees
    micro_batch_size: int


class MemoryEstimate(Spec):
    group: str
    capacity_bytes: int  # usable bytes of one device of the group
    required_bytes: int
    breakdown: dict[str, int]


class ExecutionPlan(Spec, kw_only=True):
    """Every plan places models on device groups of a cluster; this machine is a cluster too."""

    id: str = ""
    graph: GraphRef
    config: RunConfig
    target: ClusterTarget
    layout: ClusterPlan | None = None  # set by `place`
    nodes: tuple[NodePlan, ...] = ()  # set by `micro_batch`
    memory: tuple[MemoryEstimate, ...] = ()  # set by `memory`
    passes: tuple[str, ...] = ()

    def content_id(self) -> str:
        body = msgspec.json.encode(msgspec.structs.replace(self, id=""), order="sorted")
        return hashlib.sha256(body).hexdigest()[:16]

    def sealed(self) -> ExecutionPlan:
        """This plan with ``id`` set to its content hash."""
        return msgspec.structs.replace(self, id=self.content_id())

    @property
    def workload(self) -> WorkloadSpec:
        if self.target.workload is None:
            raise ConfigError("the plan has no workload yet; the 'resolve' pass derives it from the config.")
        return self.target.workload

    def node(self, name: str) -> NodePlan:
        for n in self.nodes:
            if n.node == name:
                return n
        raise KeyError(name)


def dump_plan(plan: ExecutionPlan, path: str | Path) -> Path:
    path = Path(path)
    if path.suffix in (".yaml", ".yml"):
        data = msgspec.yaml.encode(plan)
    elif path.suffix == ".json":
        data = msgspec.json.format(msgspec.json.encode(plan))
    else:
        raise ConfigError(f"plan file '{path}': use a .yaml or .json name.")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(data)
        tmp.replace(path)  # whole or absent, even if the process dies while writing
    except OSError as exc:
        raise ConfigError(f"cannot write plan file '{path}': {exc.strerror or exc}.") from None
    return path


def encode_plan(plan: ExecutionPlan, fmt: str = "yaml") -> str:
    if fmt == "json":
        return msgspec.json.format(msgspec.json.encode(plan)).decode()
    return msgspec.yaml.encode(plan).decode()


def load_plan(path: str | Path) -> ExecutionPlan:
    """Read a plan file; a plan whose content no longer matches its id is refused."""
    plan = convert(read_document(path), ExecutionPlan, f"plan file '{path}'")
    if plan.id and plan.id != plan.content_id():
        raise ConfigError(
            f"plan file '{path}' was edited after it was planned (id {plan.id} != content "
            f"{plan.content_id()}). Re-run `flowrl plan`, or delete the 'id' line to accept the edit."
        )
    return plan.sealed()
