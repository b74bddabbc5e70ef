"""Plan verification after each pass: a broken plan is refused, naming what is wrong."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from pass_helpers import plan

from flowrl.contract.plan import ExecutionPlan
from flowrl.errors import PlanError
from flowrl.planner.passes import verify_plan
from flowrl.planner.space import DeviceGroup, GenerationLayout, Parallel
from flowrl.plugins.manager import Registry


def _layout(p: ExecutionPlan, **changes: Any) -> dict[str, Any]:
    return {"layout": msgspec.structs.replace(p.layout, **changes)}


def _model(p: ExecutionPlan, model: str, **changes: Any) -> dict[str, Any]:
    models = tuple(msgspec.structs.replace(m, **changes) if m.model == model else m for m in p.layout.models)
    return _layout(p, models=models)


def _node(p: ExecutionPlan, node: str, **changes: Any) -> dict[str, Any]:
    return {"nodes": tuple(msgspec.structs.replace(n, **changes) if n.node == node else n for n in p.nodes)}


BROKEN: dict[str, tuple[Callable[[ExecutionPlan], dict[str, Any]], str]] = {
    "micro-batch above rows": (
        lambda p: _node(p, "train_actor", micro_batch_size=13),
        "node 'train_actor': micro-batch size 13 is outside 1..12",
    ),
    "micro-batch zero": (
        lambda p: _node(p, "old_logprobs", micro_batch_size=0),
        "node 'old_logprobs': micro-batch size 0",
    ),
    "node on an unknown group": (
        lambda p: _node(p, "rollout", group="gpu"),
        "node 'rollout' runs on unknown device group 'gpu'",
    ),
    "a model not placed": (
        lambda p: _layout(p, models=p.layout.models[:1]),
        "the plan places models ['actor'] but the graph declares",
    ),
    "more devices than the cluster": (
        lambda p: _layout(p, groups=(DeviceGroup(name="all", devices=2, first=0),)),
        "the plan uses 2 devices; the cluster has 1",
    ),
    "model on an unknown group": (
        lambda p: _model(p, "ref", group="gpu"),
        "model 'ref' is placed on unknown device group 'gpu'",
    ),
    "parallel sizes not filling the group": (
        lambda p: _model(p, "actor", parallel=Parallel(dp=2, tp=1, pp=1)),
        "model 'actor': dp 2 x tp 1 x pp 1 != 1 devices",
    ),
    "micro-batch above the mini-batch": (
        lambda p: _model(p, "actor", micro_batch=7),
        "model 'actor': dp 1 must divide the mini-batch of 6 sequences and micro-batch 7",
    ),
    "virtual stages without the interleaved schedule": (
        lambda p: _model(p, "actor", virtual_stages=2),
        "model 'actor': schedule '1f1b' with virtual_stages 2 over pp 1: only the interleaved schedule",
    ),
    "generation outside the cluster": (
        lambda p: _layout(p, generation=GenerationLayout(group="all", tp=1, replicas=2)),
        "generation of 'actor': tp 1 x 2 replicas must fill group 'all'",
    ),
    "memory over capacity": (
        lambda p: {"memory": (msgspec.structs.replace(p.memory[0], required_bytes=p.memory[0].capacity_bytes + 1),)},
        "per device of group 'all'",
    ),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_verify_plan_refuses_a_broken_plan(registry: Registry, case: str) -> None:
    graph, p, _ = plan("grpo", registry, "memory_limit_gib=4")
    verify_plan(graph, p)
    change, message = BROKEN[case]
    with pytest.raises(PlanError, match=re.escape(message)):
        verify_plan(graph, msgspec.structs.replace(p, **change(p)))


def test_verify_plan_refuses_a_tp_that_does_not_divide_the_heads(registry: Registry) -> None:
    graph, p, _ = plan("grpo", registry, "memory_limit_gib=4")
    assert p.target.model.heads == 2  # tp 3 does not divide them
    cluster = msgspec.structs.replace(p.target.cluster, devices_per_node=3)
    tp3 = tuple(msgspec.structs.replace(m, parallel=Parallel(dp=1, tp=3, pp=1)) for m in p.layout.models)
    layout = msgspec.structs.replace(
        p.layout,
        groups=(DeviceGroup(name="all", devices=3, first=0),),
        models=tp3,
        generation=GenerationLayout(group="all", tp=3, replicas=1),
    )
    wide = msgspec.structs.replace(p, target=msgspec.structs.replace(p.target, cluster=cluster), layout=layout)
    with pytest.raises(PlanError, match="model 'actor': tp 3 must divide 2 heads and pp 1 the 2 layers"):
        verify_plan(graph, wide)
