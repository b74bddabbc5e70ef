"""The pass manager: the pipeline's order and seal, --print-after, plugin passes, and a pass that
crashes, returns something else or breaks an invariant (named in the error)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml
from pass_helpers import QUIET, SMALL, local_plan, plan

from flowrl import api
from flowrl.contract.plan import ExecutionPlan
from flowrl.errors import PlanError, PluginError, TaskError
from flowrl.graph import Graph
from flowrl.planner.manager import run_passes
from flowrl.planner.passes import PIPELINE, verify_plan
from flowrl.plugins.hookspecs import hookimpl
from flowrl.plugins.manager import Registry, load_plugins


def test_pipeline_runs_in_order_and_seals(registry: Registry) -> None:
    assert PIPELINE == ("resolve", "place", "micro_batch", "memory")
    graph, p, out = plan("grpo", registry)
    assert p.passes == PIPELINE
    assert out == []  # nothing printed unless asked
    assert p.id == p.content_id()
    assert p.graph.fingerprint == graph.fingerprint() and p.graph.source == "grpo" and p.graph.name == "grpo"
    verify_plan(graph, p)


@pytest.mark.parametrize("source", ["ppo", "grpo", "remax", "rloo", "reinforce_pp"])
def test_every_node_and_model_is_planned(registry: Registry, source: str) -> None:
    graph, p, _ = plan(source, registry)
    assert [n.node for n in p.nodes] == graph.order()
    for n in p.nodes:
        node = graph.nodes[n.node]
        assert n.kind == node.kind
        assert n.group == ("all" if node.model else None)  # reward / compute run on the driver
        assert 1 <= n.micro_batch_size <= n.rows
    assert sorted(m.model for m in p.layout.models) == sorted(graph.models)
    assert [g.name for g in p.layout.groups] == ["all"]
    assert len(p.memory) == 1 and p.memory[0].group == "all"


def test_graph_file_path_works_like_a_name(registry: Registry) -> None:
    root = Path(__file__).resolve().parents[3]
    graph, p, _ = plan(str(root / "graphs" / "grpo.py"), registry)
    _, by_name, _ = plan("grpo", registry)
    assert p.graph.fingerprint == by_name.graph.fingerprint
    assert p.nodes == by_name.nodes
    assert p.layout == by_name.layout and p.memory == by_name.memory


def _emitted_plan(text: str, name: str) -> dict[str, Any]:
    header, _, body = text.partition("\n")
    assert header == f"# --- plan after pass '{name}' ---"
    return yaml.safe_load(body)


def test_print_after_emits_the_plan_after_that_pass(registry: Registry) -> None:
    _, p, out = plan("grpo", registry, print_after=["place"])
    assert len(out) == 1
    doc = _emitted_plan(out[0], "place")
    assert doc["passes"] == ["resolve", "place"]
    assert doc["id"] == ""  # not sealed yet
    assert doc["layout"]["placement"] == "colocate"
    assert [m["model"] for m in doc["layout"]["models"]] == ["actor", "ref"]
    assert doc["nodes"] == [] and doc["memory"] == []  # micro_batch and memory have not run
    assert doc["config"]["rollout"]["max_new_tokens"] == p.config.rollout.max_new_tokens  # resolve ran
    assert doc["target"]["workload"]["prompts_per_step"] == 4


def test_print_after_resolve_has_no_layout_yet(registry: Registry) -> None:
    _, _, out = plan("grpo", registry, print_after=["resolve"])
    doc = _emitted_plan(out[0], "resolve")
    assert doc["layout"] is None and doc["nodes"] == [] and doc["target"]["workload"] is not None


def test_print_after_all(registry: Registry) -> None:
    _, p, out = plan("grpo", registry, print_after=["all"])
    assert len(out) == len(PIPELINE)
    for i, (text, name) in enumerate(zip(out, PIPELINE)):
        assert _emitted_plan(text, name)["passes"] == list(PIPELINE[: i + 1])
    last = _emitted_plan(out[-1], "memory")
    sealed = json.loads(msgspec.json.encode(msgspec.structs.replace(p, id="")))
    assert last == sealed


def test_print_after_unknown_pass(registry: Registry) -> None:
    out: list[str] = []
    with pytest.raises(PlanError) as info:
        api.plan("grpo", registry=registry, print_after=["plase", "place"], emit=out.append)
    assert "plase" in str(info.value) and "resolve, place, micro_batch, memory" in str(info.value)
    assert out == []


class FakePasses:
    def __init__(self, fn: Any, name: str = "fake_pass") -> None:
        self.fn = fn
        self.name = name

    @hookimpl
    def register_passes(self, register: Any) -> None:
        register(self.name, self.fn, description="a test pass")


def _registry_with(fn: Any, name: str = "fake_pass") -> Registry:
    return load_plugins(entry_points=False, extra=[("fake", FakePasses(fn, name))])[1]


def _grpo(registry: Registry) -> tuple[Graph, ExecutionPlan]:
    graph, cfg = api.load("grpo", registry=registry, overrides=SMALL)
    return graph, local_plan(graph, cfg, registry)


def test_a_plugin_pass_runs_in_the_pipeline_and_is_recorded() -> None:
    def one_row_micro_batches(ctx: Any, plan: ExecutionPlan) -> ExecutionPlan:
        nodes = tuple(msgspec.structs.replace(n, micro_batch_size=1) for n in plan.nodes)
        return msgspec.structs.replace(plan, nodes=nodes)

    reg = _registry_with(one_row_micro_batches, "one_row")
    assert reg.entry("passes", "one_row").plugin == "fake"
    out: list[str] = []
    passes = (*PIPELINE, "one_row")
    graph, p = api.plan("grpo", registry=reg, overrides=SMALL, passes=passes, print_after=["one_row"], emit=out.append)
    assert p.passes == (*PIPELINE, "one_row")
    assert {n.micro_batch_size for n in p.nodes} == {1}
    assert p.id == p.content_id()
    assert len(out) == 1 and _emitted_plan(out[0], "one_row")["passes"] == [*PIPELINE, "one_row"]
    verify_plan(graph, p)


def test_crashing_plugin_pass_is_named() -> None:
    def boom(ctx: Any, plan: ExecutionPlan) -> ExecutionPlan:
        raise RuntimeError("kaboom")

    reg = _registry_with(boom)
    assert reg.entry("passes", "fake_pass").plugin == "fake"
    graph, p0 = _grpo(reg)
    with pytest.raises(PlanError) as info:
        run_passes(graph, p0, reg, passes=(*PIPELINE, "fake_pass"), emit=QUIET)
    assert "pass 'fake_pass' crashed: RuntimeError: kaboom" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_pass_returning_a_non_plan() -> None:
    reg = _registry_with(lambda ctx, plan: {"not": "a plan"})
    graph, p0 = _grpo(reg)
    with pytest.raises(PlanError, match="pass 'fake_pass' returned dict, not an ExecutionPlan"):
        run_passes(graph, p0, reg, passes=(*PIPELINE, "fake_pass"), emit=QUIET)


def test_pass_breaking_an_invariant_is_caught_after_it() -> None:
    def drop_node(ctx: Any, plan: ExecutionPlan) -> ExecutionPlan:
        return msgspec.structs.replace(plan, nodes=plan.nodes[1:])

    reg = _registry_with(drop_node)
    graph, p0 = _grpo(reg)
    with pytest.raises(PlanError, match="after pass 'fake_pass': plan covers nodes"):
        run_passes(graph, p0, reg, passes=(*PIPELINE, "fake_pass"), emit=QUIET)


def test_flowrl_error_in_a_pass_keeps_its_type_and_gets_the_pass_name() -> None:
    def refuse(ctx: Any, plan: ExecutionPlan) -> ExecutionPlan:
        raise TaskError("no such thing")

    reg = _registry_with(refuse)
    graph, p0 = _grpo(reg)
    with pytest.raises(TaskError, match="^pass 'fake_pass': no such thing$"):
        run_passes(graph, p0, reg, passes=("fake_pass",), emit=QUIET)


def test_unknown_pass_name_in_the_pipeline(registry: Registry) -> None:
    graph, p0 = _grpo(registry)
    with pytest.raises(PluginError, match="'memroy'. Did you mean 'memory'"):
        run_passes(graph, p0, registry, passes=("resolve", "memroy"), emit=QUIET)
