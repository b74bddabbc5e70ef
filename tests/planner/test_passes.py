"""Planner passes and the pass manager: pipeline order, the plan of this machine, rows,
micro-batches, memory, node options, plugin passes, errors and plan invariants."""

from __future__ import annotations

import json
import re
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from flowrl import api
from flowrl.backends.local import device as local_device
from flowrl.backends.local.executor import LOCAL_NUMERICS
from flowrl.errors import ConfigError, FlowRLError, GraphError, PlanError, PluginError, TaskError
from flowrl.graph import Graph
from flowrl.planner import memory as mem
from flowrl.planner.manager import initial_plan, run_passes
from flowrl.planner.modelspec import from_tiny
from flowrl.planner.passes import PIPELINE, PlanContext, node_rows, verify_plan
from flowrl.planner.passes import memory as memory_pass
from flowrl.planner.plan import ExecutionPlan
from flowrl.planner.space import DeviceGroup, GenerationLayout, Parallel
from flowrl.planner.workload import Fixed, WorkloadSpec
from flowrl.plugins.hookspecs import hookimpl
from flowrl.plugins.manager import Registry, load_plugins
from flowrl.specs import RunConfig, build_config
from flowrl.tasks.builtin import make_task
from flowrl.tasks.tokenizer import vocab

SMALL = ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=3"]
QUIET: Callable[[str], None] = lambda _: None  # noqa: E731


@pytest.fixture(scope="module")
def registry() -> Registry:
    return load_plugins(entry_points=False)[1]


def plan(source: str, registry: Registry, *overrides: str, **kwargs: Any) -> tuple[Graph, ExecutionPlan, list[str]]:
    out: list[str] = []
    graph, p = api.plan(source, registry=registry, overrides=[*SMALL, *overrides], emit=out.append, **kwargs)
    return graph, p, out


def local_plan(graph: Graph, cfg: RunConfig, registry: Registry, source: str = "grpo") -> ExecutionPlan:
    """The initial plan for this machine, as api.plan makes it."""
    return initial_plan(graph, source, cfg, api.local_target(cfg, registry))


def trainable(graph: Graph) -> set[str]:
    return {m for m, d in graph.models.items() if d.trainable}


def states_of(graph: Graph, p: ExecutionPlan, group: str = "all") -> int:
    t = p.target
    models = [m for m in p.layout.models if m.group == group]
    return sum(mem.state_bytes(t.model, t.numerics, m, m.model in trainable(graph)) for m in models)


def activations(p: ExecutionPlan, model: str, rows: int, *, training: bool) -> int:
    t = p.target
    lay = msgspec.structs.replace(p.layout.layout(model), micro_batch=rows)
    return mem.activation_bytes(t.model, t.numerics, lay, p.workload.max_sequence(), training=training)


# ---------------------------------------------------------------------------- the pipeline


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
    root = Path(__file__).resolve().parents[2]
    graph, p, _ = plan(str(root / "graphs" / "grpo.py"), registry)
    _, by_name, _ = plan("grpo", registry)
    assert p.graph.fingerprint == by_name.graph.fingerprint
    assert p.nodes == by_name.nodes
    assert p.layout == by_name.layout and p.memory == by_name.memory


# ---------------------------------------------------------------------------- the plan of this machine


@pytest.mark.parametrize("source", ["ppo", "grpo", "remax"])
def test_the_plan_of_this_machine_is_one_device_with_every_model_colocated(
    registry: Registry, source: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[str] = []

    def capacity(device: str) -> int:
        seen.append(device)
        return 3 * mem.GiB

    monkeypatch.setattr(local_device, "device_capacity", capacity)
    graph, p, _ = plan(source, registry)
    assert seen == ["cpu"]  # without memory_limit_gib: what the device has free
    cluster = p.target.cluster
    assert (cluster.nodes, cluster.devices_per_node, cluster.devices) == (1, 1, 1)
    assert cluster.hardware.memory_bytes == 3 * mem.GiB
    assert p.target.numerics == LOCAL_NUMERICS  # the local executor's: fp32, no recompute, no reserve
    assert p.target.model == from_tiny(RunConfig().tiny_model, len(vocab()))
    layout = p.layout
    assert layout.placement == "colocate"
    assert layout.groups == (DeviceGroup(name="all", devices=1, first=0),)
    assert sorted(m.model for m in layout.models) == sorted(graph.models)
    for m in layout.models:
        assert (m.group, m.parallel, m.offload_optimizer) == ("all", Parallel(dp=1, tp=1, pp=1), False)
    assert layout.generation == GenerationLayout(group="all", tp=1, replicas=1)
    assert (layout.rollout.mode, layout.rollout.partial, layout.weight_sync.strategy) == ("sync", False, "reshard")
    assert layout.predicted is not None and layout.predicted.memory_bytes.keys() == {"all"}
    assert {n.group for n in p.nodes if graph.nodes[n.node].model} == {"all"}
    assert p.memory[0].capacity_bytes == 3 * mem.GiB  # no reserve on the local executor

    _, limited, _ = plan(source, registry, "memory_limit_gib=1.5")
    assert seen == ["cpu"]  # a configured limit replaces the device's free memory
    assert limited.target.cluster.hardware.memory_bytes == int(1.5 * mem.GiB)
    assert limited.memory[0].capacity_bytes == int(1.5 * mem.GiB)


# ---------------------------------------------------------------------------- rows


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


def test_ppo_defaults_apply(registry: Registry) -> None:
    _, p = api.plan("ppo", registry=registry, emit=QUIET)
    from flowrl.graphs.ppo import DEFAULTS

    rollout = DEFAULTS["rollout"]
    assert {n.rows for n in p.nodes} == {rollout["prompts_per_step"] * rollout["samples_per_prompt"]}
    assert p.workload.prompts_per_step == rollout["prompts_per_step"]
    assert p.workload.samples_per_prompt == rollout["samples_per_prompt"]


# ---------------------------------------------------------------------------- resolve


def test_resolve_fills_max_new_tokens_from_the_task(registry: Registry) -> None:
    _, p, _ = plan("grpo", registry)
    assert RunConfig().rollout.max_new_tokens is None
    assert p.config.rollout.max_new_tokens == make_task(RunConfig().task).max_new_tokens()
    _, p, _ = plan("grpo", registry, "rollout.max_new_tokens=2")
    assert p.config.rollout.max_new_tokens == 2


def test_resolve_derives_the_workload_from_the_config(registry: Registry) -> None:
    graph, cfg = api.load("grpo", registry=registry, overrides=[*SMALL, "rollout.max_new_tokens=5", "train.epochs=3"])
    p0 = local_plan(graph, cfg, registry)
    assert p0.target.workload is None
    with pytest.raises(ConfigError, match="no workload yet"):
        _ = p0.workload
    p = run_passes(graph, p0, registry, passes=("resolve",), emit=QUIET)
    # the copy task: prompts '<s>' + at most 4 letters + '>'; answers of 1-4 letters + EOS, capped at the budget
    assert p.workload.response_length.lengths == [2, 3, 4, 5]
    assert p.workload == WorkloadSpec(
        prompts_per_step=4,
        samples_per_prompt=3,
        prompt_length=6,
        response_length=p.workload.response_length,
        ppo_epochs=3,
        mini_batches=2,
    )
    graph, cfg = api.load(
        "grpo", registry=registry, overrides=[*SMALL, "rollout.max_new_tokens=5", "rollout.ignore_eos=true"]
    )
    p = run_passes(graph, local_plan(graph, cfg, registry), registry, passes=("resolve",), emit=QUIET)
    assert p.workload.response_length == Fixed(value=5)  # every response runs to the budget
    # more mini-batches than sequences is refused, naming the train node
    graph, cfg = api.load("grpo", registry=registry, overrides=[*SMALL, "train.mini_batches=50"])
    message = "^pass 'resolve': node 'train_actor': 50 mini-batches but only 12 rows per step"
    with pytest.raises(PlanError, match=message):
        run_passes(graph, local_plan(graph, cfg, registry), registry, passes=("resolve",), emit=QUIET)
    graph, cfg = api.load("grpo", registry=registry, overrides=[*SMALL, "train.mini_batches=12"])
    p = run_passes(graph, local_plan(graph, cfg, registry), registry, passes=("resolve",), emit=QUIET)
    assert p.workload.mini_batches == 12
    # a workload the target gives is kept
    given = WorkloadSpec(prompts_per_step=2, samples_per_prompt=2, prompt_length=8, response_length=Fixed(value=4))
    p0 = local_plan(graph, cfg, registry)
    p0 = msgspec.structs.replace(p0, target=msgspec.structs.replace(p0.target, workload=given))
    assert run_passes(graph, p0, registry, passes=("resolve",), emit=QUIET).workload == given


# ---------------------------------------------------------------------------- place and memory


def test_place_sizes_model_states(registry: Registry) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    graph, p, _ = plan("ppo", registry, "memory_limit_gib=2", "threads=3")
    tiny = RunConfig().tiny_model
    hf = LlamaConfig(
        vocab_size=len(vocab()),
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_layers,
        num_attention_heads=tiny.num_heads,
        num_key_value_heads=tiny.num_kv_heads,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        built = sum(t.numel() for t in AutoModelForCausalLM.from_config(hf).parameters())
    params = p.target.model.parameters()
    assert params == built  # the planner's count is the model the local engines build
    assert trainable(graph) == {"actor", "critic"}
    breakdown = p.memory[0].breakdown
    # fp32 weights (4) + grads (4) + two AdamW moments (8) per trainable parameter, weights alone otherwise
    assert breakdown["model actor (weights+grads+optimizer)"] == params * 16
    assert breakdown["model critic (weights+grads+optimizer)"] == params * 16
    assert breakdown["model ref (weights)"] == params * 4
    assert p.target.cluster.hardware.memory_bytes == 2 * mem.GiB
    assert p.config.threads == 3


def test_memory_breakdown_adds_up_and_its_peak_is_the_largest_transient(registry: Registry) -> None:
    graph, p, _ = plan("ppo", registry)
    est = p.memory[0]
    assert est.required_bytes == sum(est.breakdown.values())
    assert est.required_bytes <= est.capacity_bytes
    assert sum(1 for k in est.breakdown if k.startswith("model ")) == 3
    assert sum(est.breakdown[k] for k in est.breakdown if k.startswith("model ")) == states_of(graph, p)
    t, seq = p.target, p.workload.max_sequence()
    transients = {}
    for n in p.nodes:
        if n.kind == "generate":
            transients[n.node] = mem.generation_bytes(t.model, t.numerics, p.layout.generation, n.rows, seq)
        elif n.kind in ("forward", "train"):
            model = graph.nodes[n.node].model
            transients[n.node] = activations(p, model, n.micro_batch_size, training=n.kind == "train")
    peaks = [k for k in est.breakdown if k.startswith("peak: node ")]
    assert len(peaks) == 1
    assert est.breakdown[peaks[0]] == max(transients.values())
    assert peaks[0].startswith(f"peak: node {max(transients, key=transients.__getitem__)} ")


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


# ---------------------------------------------------------------------------- --print-after


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


# ---------------------------------------------------------------------------- memory refusals


def test_too_small_memory_limit_is_refused_naming_the_group_and_the_biggest_item(registry: Registry) -> None:
    with pytest.raises(PlanError) as info:
        plan("grpo", registry, "memory_limit_gib=0.001")
    message = str(info.value)
    assert "after pass 'memory'" in message
    assert "per device of group 'all'" in message
    assert "short by" in message
    # the same plan, up to the memory pass, and its estimate
    graph, cfg = api.load("grpo", registry=registry, overrides=[*SMALL, "memory_limit_gib=0.001"])
    ctx = PlanContext(graph=graph, registry=registry)
    p = run_passes(graph, local_plan(graph, cfg, registry), registry, passes=PIPELINE[:-1], emit=QUIET, ctx=ctx)
    est = memory_pass(ctx, p).memory[0]
    assert est.group == "all" and est.required_bytes > est.capacity_bytes
    items = re.search(r"Breakdown: (.*?)\. Use ", message).group(1).split("; ")
    biggest = max(est.breakdown, key=est.breakdown.__getitem__)
    assert biggest == "model actor (weights+grads+optimizer)"
    assert items[0] == f"{biggest}: {mem.gib(est.breakdown[biggest])}"  # the biggest item first
    assert len(items) == len(est.breakdown)
    assert f"needs {mem.gib(est.required_bytes)} per device" in message
    assert f"a {p.target.cluster.hardware.name} device offers 1.0 MiB" in message


def _huge_model_dir(path: Path) -> Path:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 8192,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "intermediate_size": 28672,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    }
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))  # the shape only: no weights, no tokenizer
    return path


def test_a_70b_model_is_refused_with_numbers(registry: Registry, tmp_path: Path) -> None:
    model = _huge_model_dir(tmp_path / "llama70b")
    # place alone: the parameter count comes from config.json (nothing allocated)
    graph, cfg = api.load("grpo", registry=registry, overrides=SMALL, flags={"model": str(model)})
    placed = run_passes(graph, local_plan(graph, cfg, registry), registry, passes=("resolve", "place"), emit=QUIET)
    params = placed.target.model.parameters()
    assert 68.5e9 < params < 69.5e9
    assert sorted(m.model for m in placed.layout.models) == ["actor", "ref"]

    with pytest.raises(PlanError) as info:
        overrides = [*SMALL, "memory_limit_gib=80"]
        api.plan("grpo", registry=registry, overrides=overrides, flags={"model": str(model)}, emit=QUIET)
    message = str(info.value)
    needs = float(re.search(r"needs ([\d.]+) GiB per device of group 'all'", message).group(1))
    available = float(re.search(r"offers ([\d.]+) GiB", message).group(1))
    short = float(re.search(r"short by ([\d.]+) GiB", message).group(1))
    assert available == 80.0
    # actor: 16 bytes/param (fp32 weights + grads + AdamW moments), ref: 4 bytes/param
    assert needs > params * 20 / mem.GiB
    assert short == pytest.approx(needs - available, abs=0.02)
    actor_gib = float(re.search(r"model actor \(weights\+grads\+optimizer\): ([\d.]+) GiB", message).group(1))
    assert actor_gib == pytest.approx(params * 16 / mem.GiB, abs=0.01)
    ref_gib = float(re.search(r"model ref \(weights\): ([\d.]+) GiB", message).group(1))
    assert ref_gib == pytest.approx(params * 4 / mem.GiB, abs=0.01)


# ---------------------------------------------------------------------------- plugin passes and pass failures


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


# ---------------------------------------------------------------------------- verify_plan invariants


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


# ---------------------------------------------------------------------------- the device and the executor


def test_invalid_device_is_refused_at_plan_time(registry: Registry) -> None:
    message = "config field 'device' is 'tpu'; the local engines run on 'cpu', 'cuda', 'cuda:N' or 'auto'"
    with pytest.raises(PlanError, match=re.escape(message)):
        plan("grpo", registry, "device=tpu")


def test_cuda_without_cuda_is_refused_at_plan_time_and_by_the_executor(
    registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    graph, p, _ = plan("grpo", registry)  # on the CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(PlanError, match="config field 'device' is 'cuda' but torch sees no CUDA device here"):
        plan("grpo", registry, "device=cuda")
    on_cuda = msgspec.structs.replace(p, config=msgspec.structs.replace(p.config, device="cuda")).sealed()
    with pytest.raises(PlanError, match="config field 'device' is 'cuda' but torch sees no CUDA device here"):
        api.check(graph, on_cuda, registry)
    api.check(graph, p, registry)  # the CPU plan itself is fine


@pytest.mark.parametrize(
    ("override", "field", "what"),
    [
        ("backend=nope", "executor", "executor"),
        ("generation.engine=nope", "generation.engine", "generation engine"),
        ("train.engine=nope", "train.engine", "training engine"),
    ],
)
def test_unknown_executor_or_engine_names_the_config_field(
    registry: Registry, override: str, field: str, what: str
) -> None:
    with pytest.raises(ConfigError, match=rf"config field '{re.escape(field)}': unknown {what} 'nope'\. Known: local"):
        plan("grpo", registry, override)


def test_resolve_checks_engine_names_for_any_target(registry: Registry) -> None:
    graph, cfg = api.load("grpo", registry=registry, overrides=[*SMALL, "train.engine=locl"])
    message = "^pass 'resolve': config field 'train.engine': unknown training engine 'locl'"
    with pytest.raises(ConfigError, match=message):
        run_passes(graph, local_plan(graph, cfg, registry), registry, emit=QUIET)


# ---------------------------------------------------------------------------- resolve errors


def _graph(
    reward_fn: str = "task",
    compute_fn: str = "grpo",
    compute_reads: str = "rewards responses",
    compute_writes: str = "advantages",
    loss: str = "ppo",
    train: dict[str, Any] | None = None,
    compute: dict[str, Any] | None = None,
    forward: dict[str, Any] | None = None,
) -> Graph:
    g = Graph("custom")
    g.model("actor", "actor")
    g.generate("rollout", model="actor", n=2)
    g.forward(
        "old_logprobs", model="actor", output="logprobs", reads="responses", writes="old_logprobs", **(forward or {})
    )
    g.reward("reward", fn=reward_fn)
    g.compute("adv", fn=compute_fn, reads=compute_reads, writes=compute_writes, **(compute or {}))
    g.train("train_actor", model="actor", loss=loss, reads="responses old_logprobs advantages", **(train or {}))
    return g.verify()


def _resolve(graph: Graph, registry: Registry, **config: Any) -> ExecutionPlan:
    cfg = build_config({"rollout": {"prompts_per_step": 2, "samples_per_prompt": 2}}, config)
    return run_passes(graph, local_plan(graph, cfg, registry, "custom.py"), registry, emit=QUIET)


def test_custom_graph_plans(registry: Registry) -> None:
    p = _resolve(_graph(), registry)
    assert p.graph.source == "custom.py" and p.passes == PIPELINE


def test_unknown_reward_function(registry: Registry) -> None:
    with pytest.raises(FlowRLError) as info:
        _resolve(_graph(reward_fn="taks"), registry)
    message = str(info.value)
    assert message.startswith("pass 'resolve': ")
    assert "unknown reward function 'taks'" in message and "Did you mean 'task'?" in message


def test_unknown_loss(registry: Registry) -> None:
    with pytest.raises(FlowRLError) as info:
        _resolve(_graph(loss="ppo2"), registry)
    message = str(info.value)
    assert "pass 'resolve'" in message and "'ppo2'" in message and "Did you mean 'ppo'?" in message


def test_unknown_compute_function(registry: Registry) -> None:
    with pytest.raises(FlowRLError, match="unknown compute function 'grpoo'"):
        _resolve(_graph(compute_fn="grpoo"), registry)


def test_compute_function_needs_a_key_the_node_does_not_read(registry: Registry) -> None:
    # gae needs values (and rewards, responses); this node forgets values
    graph = _graph(compute_fn="gae", compute_reads="rewards responses", compute_writes="advantages")
    with pytest.raises(PlanError) as info:
        _resolve(graph, registry)
    message = str(info.value)
    assert "pass 'resolve'" in message and "node 'adv'" in message
    assert "compute function 'gae'" in message and "needs key 'values'" in message


def test_compute_node_writes_a_key_the_function_does_not_give(registry: Registry) -> None:
    graph = _graph(compute_writes="advantages returns")
    message = "node 'adv' writes key 'returns', but compute function 'grpo' only produces advantages"
    with pytest.raises(PlanError, match=message):
        _resolve(graph, registry)


def test_loss_needs_a_key_the_train_node_does_not_read(registry: Registry) -> None:
    g = Graph("custom")
    g.model("actor", "actor")
    g.generate("rollout", model="actor", n=2)
    g.reward("reward", fn="task")
    g.compute("adv", fn="grpo", reads="rewards responses", writes="advantages")
    g.train("train_actor", model="actor", loss="ppo", reads="responses advantages")
    with pytest.raises(PlanError, match="node 'train_actor': loss 'ppo' needs key 'old_logprobs'"):
        _resolve(g.verify(), registry)


def test_value_loss_on_an_actor_is_refused(registry: Registry) -> None:
    g = Graph("custom")
    g.model("actor", "actor")
    g.generate("rollout", model="actor", n=2)
    g.forward("values", model="actor", output="logprobs", reads="responses", writes="values")
    g.reward("reward", fn="task")
    g.compute("gae", fn="gae", reads="rewards values responses", writes="advantages returns")
    g.train("train_actor", model="actor", loss="value", reads="responses values returns")
    message = "node 'train_actor': loss 'value' trains on values, but model 'actor' \\(role actor\\) produces logprobs"
    with pytest.raises(PlanError, match=message):
        _resolve(g.verify(), registry)


def test_unknown_task(registry: Registry) -> None:
    with pytest.raises(TaskError, match="pass 'resolve'.*unknown task 'ad'"):
        _resolve(_graph(), registry, task="ad")


# ---------------------------------------------------------------------------- node options (checked at plan time)


def test_valid_node_options_plan(registry: Registry) -> None:
    graph = _graph(
        train={"epochs": 2, "mini_batches": 1, "clip_low": 0.1},
        compute={"eps": 1e-4, "scale": False},
        forward={"kl_coef": 0.0},
    )
    assert _resolve(graph, registry).passes == PIPELINE


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"train": {"warmup": 3}}, "node 'train_actor': unknown option(s) warmup; allowed: "),
        ({"compute": {"epsilon": 1e-4}}, "node 'adv': unknown option(s) epsilon; allowed: "),
        ({"forward": {"epochs": 2}}, "node 'old_logprobs': unknown option(s) epochs; allowed: "),
        ({"train": {"clip_low": "wide"}}, "node 'train_actor': bad option: "),
        ({"train": {"kl_estimator": "k9"}}, "node 'train_actor': bad option: "),
        ({"train": {"epochs": 0}}, "node 'train_actor': option 'epochs' must be an integer >= 1, got 0."),
        (
            {"train": {"mini_batches": 1.5}},
            "node 'train_actor': option 'mini_batches' must be an integer >= 1, got 1.5.",
        ),
        ({"train": {"epochs": True}}, "node 'train_actor': option 'epochs' must be an integer >= 1, got True."),
    ],
)
def test_bad_node_options_are_refused_by_resolve(registry: Registry, options: dict[str, Any], message: str) -> None:
    with pytest.raises(GraphError) as info:
        _resolve(_graph(**options), registry)
    assert str(info.value).startswith("pass 'resolve': ")
    assert message in str(info.value)


def test_a_train_node_with_more_mini_batches_than_rows_is_refused(registry: Registry) -> None:
    # 2 prompts x 2 samples: 4 rows reach the train node
    assert _resolve(_graph(train={"mini_batches": 4}), registry).node("train_actor").rows == 4
    with pytest.raises(PlanError, match="^pass 'resolve': node 'train_actor': 5 mini-batches but only 4 rows per step"):
        _resolve(_graph(train={"mini_batches": 5}), registry)


def test_unknown_option_lists_what_is_allowed(registry: Registry) -> None:
    with pytest.raises(GraphError) as info:
        _resolve(_graph(compute={"epsilon": 1e-4}), registry)
    allowed = str(info.value).split("allowed: ", 1)[1]
    assert "eps" in allowed and "scale" in allowed and "clip_low" in allowed


def test_api_plan_refuses_an_unknown_node_option_in_a_graph_file(registry: Registry, tmp_path: Path) -> None:
    source = tmp_path / "opts.py"
    source.write_text(
        textwrap.dedent("""
        from flowrl.graph import Graph


        def build(cfg):
            g = Graph("opts")
            g.model("actor", "actor")
            g.model("ref", "reference", init_from="actor")
            g.generate("rollout", model="actor", n=cfg.rollout.samples_per_prompt)
            g.forward("old_logprobs", model="actor", output="logprobs", reads="responses", writes="old_logprobs")
            g.forward("ref_logprobs", model="ref", output="logprobs", reads="responses", writes="ref_logprobs")
            g.reward("reward", fn="task")
            g.compute("advantages", fn="grpo", reads="rewards responses", writes="advantages")
            g.train("train_actor", model="actor", loss="ppo", reads="responses old_logprobs ref_logprobs advantages",
                    epochs=2, warmup_steps=10)
            return g
    """)
    )
    out: list[str] = []
    with pytest.raises(GraphError) as info:
        api.plan(str(source), registry=registry, overrides=SMALL, emit=out.append, print_after=["all"])
    message = str(info.value)
    assert message.startswith("pass 'resolve': node 'train_actor': unknown option(s) warmup_steps")
    assert "epochs" in message.split("allowed: ", 1)[1]
    assert out == []  # refused in the first pass, before anything is printed
