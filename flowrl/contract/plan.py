"""The ExecutionPlan: a frozen msgspec struct, JSON/YAML round-trippable, content-hashed.

Besides the graph, it is the only thing an executor receives. The planner makes it
(`flowrl.planner`); executors, engines and plugins read it from here.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import msgspec

from flowrl.contract.capabilities import Capabilities
from flowrl.contract.hardware import CONTROLLER_ROW_SECONDS, TP_OP_OVERHEAD, ClusterSpec
from flowrl.contract.layout import ClusterPlan
from flowrl.contract.model import ModelSpec
from flowrl.contract.numerics import Numerics
from flowrl.contract.objective import PlanObjective
from flowrl.contract.resolved import ModelRun, NodeOptions
from flowrl.contract.workload import WorkloadSpec
from flowrl.errors import ConfigError, PlanError
from flowrl.specs import (
    LATER_SECTIONS,
    RUN_SETTINGS,
    RunConfig,
    Spec,
    convert,
    current_names,
    read_document,
)


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
    runs: str | None = None  # a generate node's episodes: "agent REF" or "env NAME" (None: single-turn)


class MemoryEstimate(Spec):
    group: str
    capacity_bytes: int  # usable bytes of one device of the group
    required_bytes: int
    breakdown: dict[str, int]


#: HardwareSpec fields added after plans were first written, at their defaults: left out of plan ids.
LATER_HARDWARE = {
    "task_overhead": 0.0,
    "decode_step_overhead": 0.0,
    "decode_row_overhead": 0.0,
    "generate_overhead": 0.0,
    "optimizer_tensor_overhead": 0.0,
    "controller_row_overhead": CONTROLLER_ROW_SECONDS,
    "sync_tensor_overhead": 0.0,
    "calibration": None,
}


class ExecutionPlan(Spec, kw_only=True):
    """Every plan places models on device groups of a cluster; this machine is a cluster too."""

    id: str = ""
    graph: GraphRef
    config: RunConfig
    target: ClusterTarget
    layout: ClusterPlan | None = None  # set by `place`
    options: dict[str, NodeOptions] = {}  # node -> its resolved options; set by `resolve`
    models: dict[str, ModelRun] = {}  # graph model -> what its engines run; set by `resolve` (generation by `place`)
    nodes: tuple[NodePlan, ...] = ()  # set by `micro_batch`
    memory: tuple[MemoryEstimate, ...] = ()  # set by `memory`
    passes: tuple[str, ...] = ()
    # forward node -> the train node that computes its output in its own forward, detached: the old
    # log-probs of a policy taking one update per batch are the log-probs it trains on (set by `resolve`)
    fused: dict[str, str] = {}
    # what the tuner ranked the plan's candidates by (--objective) and its winner's predicted time to the
    # target reward (set by `place`; None: not placed by the tuner, or a plan written before objectives)
    objective: PlanObjective | None = None

    def content_id(self) -> str:
        """The hash of what is planned: every field but the id and the config's run settings
        (``RUN_SETTINGS``: where the run goes, how it checkpoints), which may change without
        changing the plan."""
        body = msgspec.to_builtins(msgspec.structs.replace(self, id=""))
        for name in RUN_SETTINGS:
            body["config"].pop(name, None)
        if not body["fused"]:  # plans written before fusion keep their ids
            body.pop("fused")
        if body.get("objective") is None:  # ... and before objectives
            body.pop("objective", None)
        # and before sharded states and whole gathering (the executor's numerics, also in its capabilities),
        # and before pipeline parallelism was declared apart from tensor parallelism (its default: as before)
        caps = body["target"].get("capabilities") or {}
        flags = ("sharded_states", "gather_whole", "static_decode")  # ... and before static decode batches
        later = [(body["target"]["numerics"], flag) for flag in flags]
        for numerics, flag in [*later, *((caps.get("numerics") or {}, flag) for flag in flags[1:])]:
            if flag in numerics and not numerics[flag]:
                numerics.pop(flag)
        if caps.get("pipeline_parallel") is True:
            caps.pop("pipeline_parallel")
        for layout in (body.get("layout") or {}).get("models") or ():
            if layout.get("schedule") == "1f1b" and layout.get("virtual_stages") == 1:  # and before pipeline schedules
                layout.pop("schedule")
                layout.pop("virtual_stages")
        hardware = (body["target"].get("cluster") or {}).get("hardware") or {}
        if hardware.get("tp_op_overhead") == TP_OP_OVERHEAD:  # and before tp's host work was priced
            hardware.pop("tp_op_overhead")
        for key, value in LATER_HARDWARE.items():  # and before calibration's factors
            if hardware.get(key) == value:
                hardware.pop(key)
        for node in body.get("nodes") or ():  # and before plans named what plays a node's episodes
            if node.get("runs") is None:
                node.pop("runs", None)
        for spec in (body["target"]["model"], *(body["target"].get("models") or {}).values()):
            if spec.get("scalar_head") is False:  # and before scalar heads were shapes of their own
                spec.pop("scalar_head")
        workload = body["target"].get("workload") or {}
        # and before episodes were costed, and before padded rows
        for key, value in (("turns", 1), ("env_s_per_turn", 0.0), ("padded_to", None)):
            if workload.get(key) == value:
                workload.pop(key)
        default = msgspec.to_builtins(RunConfig())
        for name in LATER_SECTIONS:  # left at their defaults, plans written before them keep their ids
            *parents, leaf = name.split(".")
            here, there = body["config"], default
            for part in parents:
                here, there = here.get(part, {}), there[part]
            if leaf in here and here[leaf] == there[leaf]:
                here.pop(leaf)
        for options in (body.get("options") or {}).values():  # and each node's algo (its options' copy)
            algo = options.get("algo") or {}
            for name in LATER_SECTIONS:
                section, _, leaf = name.partition(".")
                if section == "algo" and leaf in algo and algo[leaf] == default["algo"][leaf]:
                    algo.pop(leaf)
        return hashlib.sha256(msgspec.json.encode(body, order="sorted")).hexdigest()[:16]

    def with_run_settings(self, settings: dict[str, Any]) -> ExecutionPlan:
        """This plan with run settings replaced (``--out``, ``--save-every`` for a ``--plan`` or
        ``--resume`` run); its id does not change, and the run's plan.yaml records them."""
        bad = sorted(set(settings) - set(RUN_SETTINGS))
        if bad:
            raise ConfigError(f"{', '.join(bad)}: not run settings ({', '.join(RUN_SETTINGS)}); they are plan content.")
        config = convert({**msgspec.to_builtins(self.config), **settings}, RunConfig, "config")
        return msgspec.structs.replace(self, config=config).sealed()

    def sealed(self) -> ExecutionPlan:
        """This plan with ``id`` set to its content hash."""
        return msgspec.structs.replace(self, id=self.content_id())

    @property
    def workload(self) -> WorkloadSpec:
        if self.target.workload is None:
            raise ConfigError("the plan has no workload yet; the 'resolve' pass derives it from the config.")
        return self.target.workload

    def node_options(self, name: str) -> NodeOptions:
        """Node ``name``'s resolved options (the `resolve` pass sets them)."""
        if name not in self.options:
            raise PlanError(f"the plan has no resolved options for node '{name}'; make it with `flowrl plan`.")
        return self.options[name]

    def model_run(self, model: str) -> ModelRun:
        """What the engines of graph model ``model`` run (the `resolve` pass sets it)."""
        if model not in self.models:
            raise PlanError(f"the plan has no resolved spec for model '{model}'; make it with `flowrl plan`.")
        return self.models[model]

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
    """Read a plan file; a plan whose content no longer matches its id is refused.

    A plan an earlier flowrl wrote loads too: its config's older field names are read as today's
    (``backend`` -> ``executor``), and its id, the hash of the whole document as written then,
    is checked against the document; it gets today's content id."""
    raw = read_document(path)
    data = dict(raw)
    if isinstance(data.get("config"), dict):
        try:
            data["config"] = current_names(data["config"])
        except ConfigError as exc:
            raise ConfigError(f"plan file '{path}': {exc}") from None
    plan = convert(data, ExecutionPlan, f"plan file '{path}'")
    if plan.id and plan.id != plan.content_id() and plan.id != _written_id(raw):
        raise ConfigError(
            f"plan file '{path}' was edited after it was planned (id {plan.id} != content "
            f"{plan.content_id()}). Re-run `flowrl plan`, or delete the 'id' line to accept the edit."
        )
    return plan.sealed()


def _written_id(document: dict[str, Any]) -> str:
    """The id an earlier flowrl gave a plan document: the hash of all of it (its id empty), as written."""
    body = msgspec.json.encode({**document, "id": ""}, order="sorted")
    return hashlib.sha256(body).hexdigest()[:16]
