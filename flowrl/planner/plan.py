"""Moved to `flowrl.contract.plan` (the plan's types) and `flowrl.contract.resolved` (the per-model
specs); this name stays until every importer uses the contract."""

from flowrl.contract.layout import ClusterPlan
from flowrl.contract.plan import (
    LATER_HARDWARE,
    ClusterTarget,
    ExecutionPlan,
    GraphRef,
    MemoryEstimate,
    NodePlan,
    dump_plan,
    encode_plan,
    load_plan,
)
from flowrl.contract.resolved import EngineNumerics, ModelRun, NodeOptions, OptimizerSpec, SamplingSpec

__all__ = [
    "LATER_HARDWARE",
    "ClusterPlan",
    "ClusterTarget",
    "EngineNumerics",
    "ExecutionPlan",
    "GraphRef",
    "MemoryEstimate",
    "ModelRun",
    "NodeOptions",
    "NodePlan",
    "OptimizerSpec",
    "SamplingSpec",
    "dump_plan",
    "encode_plan",
    "load_plan",
]
