"""The ``micro_batch`` pass: rows per step propagated from generate nodes, and micro-batches
(configured, the layout's, halved until they fit, never beyond a mini-batch)."""

from __future__ import annotations

import pytest
from pass_helpers import QUIET, SMALL, activations, local_plan, plan, states_of

from flowrl import api
from flowrl.graph import Graph
from flowrl.planner import memory as mem
from flowrl.planner.manager import run_passes
from flowrl.planner.passes import node_rows
from flowrl.plugins.manager import Registry


def test_rows_propagate_from_generate(registry: Registry) -> None:
    _, p, _ = plan("grpo", registry)
    rows = {n.node: n.rows for n in p.nodes}
    # 4 prompts x 3 samples: the rollout produces 12 sequences, and every node downstream
    # of it (forward, reward, compute, train) sees those 12
    nodes = ("rollout", "old_logprobs", "ref_logprobs", "reward", "advantages", "train_actor")
    assert rows == dict.fromkeys(nodes, 12)


def test_greedy_generate_keeps_one_row_per_prompt(registry: Registry) -> None:
    _, p, _ = plan("remax", registry)
    rows = {n.node: n.rows for n in p.nodes}
    assert rows["rollout"] == 12
    assert rows["greedy"] == 4 and rows["baseline_reward"] == 4
    assert rows["advantages"] == 12 and rows["train_actor"] == 12


def test_node_rows_without_generate_and_with_two_samplers() -> None:
    g = Graph("rows")
    g.model("actor", "actor", trainable=False)
    g.compute("filter", fn="f", reads="prompts", writes="kept")
    g.generate("a", model="actor", reads="kept", writes="ra", n=3)
    g.generate("b", model="actor", reads="ra", writes="rb", n=2)
    assert node_rows(g, 5) == {"filter": 5, "a": 15, "b": 30}


@pytest.mark.parametrize(
    ("source", "size", "layout", "forward"),
    [
        ("remax", 5, 5, 5),
        ("remax", 1, 1, 1),
        ("ppo", 4, 4, 4),
        (
            "remax",
            50,
            6,
            12,
        ),  # the layout's and a train node's are capped at the mini-batch (12 / 2), a forward's at its rows
    ],
)
def test_train_micro_batch_size_is_honoured_in_the_nodes_and_the_layout(
    registry: Registry, source: str, size: int, layout: int, forward: int
) -> None:
    graph, p, _ = plan(source, registry, f"train.micro_batch_size={size}")
    assert {m.model: m.micro_batch for m in p.layout.models} == {m: layout for m in graph.models}
    for n in p.nodes:
        if n.kind == "forward":
            assert (n.rows, n.micro_batch_size) == (12, forward), n
        elif n.kind == "train":
            assert n.rows == 12 and n.micro_batch_size == min(size, n.rows // p.config.train.mini_batches), n
        else:  # generate / reward / compute take the whole batch
            assert n.micro_batch_size == n.rows, n


def test_a_train_micro_batch_never_exceeds_its_mini_batch(registry: Registry) -> None:
    _, p, _ = plan("remax", registry, "train.micro_batch_size=50")
    _, capped, _ = plan("remax", registry, "train.micro_batch_size=6")
    assert p.node("train_actor").micro_batch_size == p.layout.layout("actor").micro_batch == 6
    assert p.memory[0].breakdown == capped.memory[0].breakdown  # the same run, the same memory


def test_micro_batch_is_the_layouts_when_it_fits(registry: Registry) -> None:
    graph, roomy, _ = plan("grpo", registry, "memory_limit_gib=4")
    mini_batch = roomy.workload.sequences // roomy.workload.mini_batches
    assert mini_batch == 6 and {m.micro_batch for m in roomy.layout.models} == {6}
    for n in roomy.nodes:
        assert n.micro_batch_size == (6 if n.kind in ("forward", "train") else n.rows), n
    # one mini-batch: the largest micro-batch is the whole batch
    _, whole, _ = plan("grpo", registry, "memory_limit_gib=4", "train.mini_batches=1")
    assert all(n.micro_batch_size == n.rows == 12 for n in whole.nodes)


def _halvings(start: int) -> list[int]:
    sizes = [start]
    while sizes[-1] > 1:
        sizes.append((sizes[-1] + 1) // 2)
    return sizes


def test_micro_batch_shrinks_to_the_largest_that_fits(registry: Registry) -> None:
    overrides = [*SMALL, "train.mini_batches=1"]
    graph, roomy, _ = plan("grpo", registry, "memory_limit_gib=4", "train.mini_batches=1")
    assert all(n.micro_batch_size == n.rows for n in roomy.nodes)
    act12 = activations(roomy, "actor", 12, training=True)
    states = states_of(graph, roomy)
    # the pass keeps half of (capacity - states) for activations: make that ~act12 / 3, so
    # 12 and 6 rows do not fit and 3 rows (act12 / 4) do
    limit = (states + 2 * (act12 // 3) + 1024) / mem.GiB
    graph, cfg = api.load("grpo", registry=registry, overrides=[*overrides, f"memory_limit_gib={limit!r}"])
    passes = ("resolve", "place", "micro_batch")
    p = run_passes(graph, local_plan(graph, cfg, registry), registry, passes=passes, emit=QUIET)
    budget = (mem.usable_bytes(p.target.cluster.hardware, p.target.numerics) - states_of(graph, p)) // 2
    assert act12 // 4 <= budget < act12 // 2
    assert p.node("train_actor").rows == 12
    assert p.node("train_actor").micro_batch_size == 3
    assert p.node("rollout").micro_batch_size == 12  # generate is not micro-batched
    for n in p.nodes:  # every forward / train node: the largest halving of 12 where its model's activations fit
        if n.kind in ("forward", "train"):
            model = graph.nodes[n.node].model
            training = graph.models[model].trainable
            fits = [s for s in _halvings(12) if activations(p, model, s, training=training) <= budget]
            assert n.micro_batch_size == (fits[0] if fits else 1), n
    # a configured micro-batch is not shrunk (the memory pass judges it)
    configured = [*overrides, f"memory_limit_gib={limit!r}", "train.micro_batch_size=12"]
    graph, cfg = api.load("grpo", registry=registry, overrides=configured)
    p = run_passes(graph, local_plan(graph, cfg, registry), registry, passes=passes, emit=QUIET)
    assert p.node("train_actor").micro_batch_size == 12
