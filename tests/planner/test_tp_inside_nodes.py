"""The planner keeps tensor parallelism inside a node: a tp row (one model copy's consecutive ranks) never
spans a node boundary, also in a device group that straddles one (data parallelism may)."""

from __future__ import annotations

import pytest

from flowrl.contract.layout import DeviceGroup, tp_inside_nodes
from flowrl.planner.modelspec import MODEL_PRESETS
from flowrl.planner.space import Roles, layouts, skeletons


@pytest.mark.parametrize(
    ("first", "devices", "tp", "per_node", "inside"),
    [
        (0, 4, 2, 2, True),  # two nodes, a tp row on each
        (1, 2, 2, 2, False),  # devices 1 and 2: one on each node
        (1, 2, 1, 2, True),
        (2, 8, 4, 4, False),  # rows 2..5 and 6..9 both straddle
        (4, 8, 4, 4, True),
        (0, 3, 2, 8, True),  # a part of one node
    ],
)
def test_a_tp_row_is_inside_a_node_exactly_when_its_devices_share_one(first, devices, tp, per_node, inside):
    assert tp_inside_nodes(first, devices, tp, per_node) is inside


def test_no_layout_or_generation_split_crosses_a_node_on_a_two_node_cluster():
    spec = MODEL_PRESETS["llama-7b"]
    roles = Roles(
        models=("actor", "ref"),
        actor="actor",
        trainable=frozenset({"actor"}),
        role=(("actor", "actor"), ("ref", "reference")),
    )
    per_node, seen_straddling = 4, 0
    for sk in skeletons(roles, 8, per_node, spec.heads, spec.kv_heads, intermediate=spec.intermediate):
        groups = {g.name: g for g in sk.groups}
        gen = groups[sk.generation.group]
        assert tp_inside_nodes(gen.first, gen.devices, sk.generation.tp, per_node), sk
        for g in sk.groups:
            straddles = g.first // per_node != (g.first + g.devices - 1) // per_node and g.devices <= per_node
            seen_straddling += straddles
            for opt in layouts("actor", g, trainable=True, per_node=per_node, heads=spec.heads,
                               kv_heads=spec.kv_heads, layers=spec.layers, batch=64):  # fmt: skip
                assert tp_inside_nodes(g.first, g.devices, opt.parallel.tp, per_node), (g, opt.parallel)
    assert seen_straddling  # the space has groups across a node boundary: the check had work to do
    # a group of two on devices 3 and 4 trains tp 1 only; at 4 and 5, tp 2 too
    straddling = DeviceGroup(name="ref", devices=2, first=3)
    tps = {o.parallel.tp for o in layouts("ref", straddling, trainable=False, per_node=4, heads=32, kv_heads=32,
                                          layers=32, batch=64)}  # fmt: skip
    assert tps == {1}
    aligned = DeviceGroup(name="ref", devices=2, first=4)
    assert 2 in {o.parallel.tp for o in layouts("ref", aligned, trainable=False, per_node=4, heads=32, kv_heads=32,
                                                 layers=32, batch=64)}  # fmt: skip
