"""Planner passes and the pass manager: pipeline order, rows, micro-batches, memory, errors."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from flowrl import api
from flowrl.errors import FlowRLError, PlanError, PluginError, TaskError
from flowrl.graph import Graph
from flowrl.planner import memory as mem
from flowrl.planner.manager import initial_plan, run_passes
from flowrl.planner.passes import DEFAULT_PIPELINE, node_rows, verify_plan
from flowrl.planner.plan import ExecutionPlan
from flowrl.plugins.hookspecs import hookimpl
from flowrl.plugins.manager import Registry, load_plugins
from flowrl.specs import RunConfig, build_config
from flowrl.tasks.builtin import make_task

SMALL = ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=3"]


@pytest.fixture(scope="module")
def registry() -> Registry:
    return load_plugins(entry_points=False)[1]


def plan(source: str, registry: Registry, *overrides: str, **kwargs: Any) -> tuple[Graph, ExecutionPlan, list[str]]:
    out: list[str] = []
    graph, p = api.plan(source, registry=registry, overrides=[*SMALL, *overrides], emit=out.append, **kwargs)
    return graph, p, out


# ---------------------------------------------------------------------------- the default pipeline


def test_default_pipeline_runs_in_order_and_seals(registry: Registry) -> None:
    assert DEFAULT_PIPELINE == ("resolve", "place", "micro_batch", "memory")
    graph, p, out = plan("grpo", registry)
    assert p.passes == DEFAULT_PIPELINE
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
        assert n.device == ("cpu" if node.model else None)
        assert 1 <= n.micro_batch_size <= n.rows
    assert sorted(m.model for m in p.models) == sorted(graph.models)
    assert [d.name for d in p.devices] == ["cpu"]
    assert len(p.memory) == 1 and p.memory[0].device == "cpu"


def test_graph_file_path_works_like_a_name(registry: Registry) -> None:
    root = Path(__file__).resolve().parents[2]
    graph, p, _ = plan(str(root / "graphs" / "grpo.py"), registry)
    _, by_name, _ = plan("grpo", registry)
    assert p.graph.fingerprint == by_name.graph.fingerprint
    assert p.nodes == by_name.nodes


# ---------------------------------------------------------------------------- rows


def test_rows_propagate_from_generate(registry: Registry) -> None:
    _, p, _ = plan("grpo", registry)
    rows = {n.node: n.rows for n in p.nodes}
    # 4 prompts x 3 samples: the rollout produces 12 sequences, and every node downstream
    # of it (forward, reward, compute, train) sees those 12
    assert rows == {"rollout": 12, "old_logprobs": 12, "ref_logprobs": 12, "reward": 12, "advantages": 12, "train_actor": 12}


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
    out: list[str] = []
    _, p = api.plan("ppo", registry=registry, emit=out.append)
    from flowrl.graphs.ppo import DEFAULTS

    rollout = DEFAULTS["rollout"]
    assert {n.rows for n in p.nodes} == {rollout["prompts_per_step"] * rollout["samples_per_prompt"]}


# ---------------------------------------------------------------------------- pass effects


def test_resolve_fills_max_new_tokens_from_the_task(registry: Registry) -> None:
    _, p, _ = plan("grpo", registry)
    assert RunConfig().rollout.max_new_tokens is None
    assert p.config.rollout.max_new_tokens == make_task(RunConfig().task).max_new_tokens()
    _, p, _ = plan("grpo", registry, "rollout.max_new_tokens=2")
    assert p.config.rollout.max_new_tokens == 2


def test_place_sizes_model_states(registry: Registry) -> None:
    _, p, _ = plan("ppo", registry, "memory_limit_gib=2", "threads=3")
    models = {m.model: m for m in p.models}
    assert models["actor"].trainable and models["critic"].trainable and not models["ref"].trainable
    actor_params = models["actor"].parameters
    assert models["ref"].parameters == actor_params
    assert models["critic"].parameters == actor_params + RunConfig().tiny_model.hidden_size + 1  # value head
    for m in p.models:
        assert m.state_bytes == m.parameters * (16 if m.trainable else 4)
        assert (m.device, m.dtype) == ("cpu", "float32")
    assert p.devices[0].memory_bytes == 2 * mem.GiB
    assert p.devices[0].threads == 3


def test_memory_breakdown_adds_up(registry: Registry) -> None:
    _, p, _ = plan("ppo", registry)
    est = p.memory[0]
    assert est.required_bytes == sum(est.breakdown.values())
    assert est.required_bytes <= est.capacity_bytes
    assert sum(1 for k in est.breakdown if k.startswith("model ")) == 3
    assert any(k.startswith("activations (peak: node ") for k in est.breakdown)


@pytest.mark.parametrize(("size", "expected"), [(5, 5), (1, 1), (50, 12)])
def test_configured_micro_batch_size_is_respected(registry: Registry, size: int, expected: int) -> None:
    _, p, _ = plan("remax", registry, f"train.micro_batch_size={size}")
    for n in p.nodes:
        if n.kind in ("forward", "train"):
            assert (n.rows, n.micro_batch_size) == (12, expected), n
        else:  # generate / reward / compute take the whole batch
            assert n.micro_batch_size == n.rows, n


def test_micro_batch_shrinks_to_fit_the_budget(registry: Registry) -> None:
    from flowrl.planner.passes import PlanContext, _seq_len

    _, roomy, _ = plan("grpo", registry, "memory_limit_gib=4")
    assert all(n.micro_batch_size == n.rows for n in roomy.nodes)
    graph, cfg = api.load("grpo", registry=registry, overrides=SMALL)
    ctx = PlanContext(graph=graph, registry=registry)
    act12 = mem.activation_bytes(ctx.model_config(roomy), 12, _seq_len(ctx, roomy), training=True)
    states = sum(m.state_bytes for m in roomy.models)
    # the pass keeps half of (capacity - states) for activations: make that ~act12 / 3, so
    # 12 and 6 rows do not fit and 3 rows (act12 / 4) do
    limit = (states + 2 * (act12 // 3) + 1024) / mem.GiB
    cfg = msgspec.structs.replace(cfg, memory_limit_gib=limit)
    p = run_passes(graph, initial_plan(graph, "grpo", cfg), registry, passes=("resolve", "place", "micro_batch"), emit=lambda _: None)
    assert p.node("train_actor").rows == 12
    assert p.node("train_actor").micro_batch_size == 3
    assert p.node("rollout").micro_batch_size == 12  # generate is not micro-batched


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
    assert [m["model"] for m in doc["models"]] == ["actor", "ref"]
    assert doc["nodes"] == [] and doc["memory"] == []  # micro_batch and memory have not run
    assert doc["config"]["rollout"]["max_new_tokens"] == p.config.rollout.max_new_tokens  # resolve ran


def test_print_after_all(registry: Registry) -> None:
    _, p, out = plan("grpo", registry, print_after=["all"])
    assert len(out) == len(DEFAULT_PIPELINE)
    for i, (text, name) in enumerate(zip(out, DEFAULT_PIPELINE)):
        assert _emitted_plan(text, name)["passes"] == list(DEFAULT_PIPELINE[: i + 1])
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


def test_too_small_memory_limit_is_refused(registry: Registry) -> None:
    with pytest.raises(PlanError) as info:
        plan("grpo", registry, "memory_limit_gib=0.001")
    message = str(info.value)
    assert "after pass 'memory'" in message
    assert "short by" in message and "device 'cpu'" in message
    assert "only 1.0 MiB is available" in message
    assert "model actor (weights+grads+adam)" in message


def _huge_model_dir(path: Path) -> Path:
    from flowrl.tasks.tokenizer import build_tokenizer

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
    (path / "config.json").write_text(json.dumps(config))
    build_tokenizer().save_pretrained(str(path))
    return path


def test_a_70b_model_is_refused_with_numbers(registry: Registry, tmp_path: Path) -> None:
    model = _huge_model_dir(tmp_path / "llama70b")
    # place alone: the parameter count comes from config.json (meta device, nothing allocated)
    graph, cfg = api.load("grpo", registry=registry, overrides=SMALL, flags={"model": str(model)})
    placed = run_passes(graph, initial_plan(graph, "grpo", cfg), registry, passes=("resolve", "place"), emit=lambda _: None)
    params = {m.model: m.parameters for m in placed.models}
    assert 68.5e9 < params["actor"] < 69.5e9 and params["ref"] == params["actor"]

    with pytest.raises(PlanError) as info:
        api.plan("grpo", registry=registry, overrides=[*SMALL, "memory_limit_gib=80"], flags={"model": str(model)}, emit=lambda _: None)
    message = str(info.value)
    needs = float(re.search(r"needs ([\d.]+) GiB on device 'cpu'", message).group(1))
    available = float(re.search(r"only ([\d.]+) GiB is available", message).group(1))
    short = float(re.search(r"short by ([\d.]+) GiB", message).group(1))
    assert available == 80.0
    # actor: 16 bytes/param (weights + grads + Adam), ref: 4 bytes/param
    assert needs > params["actor"] * 20 / mem.GiB
    assert short == pytest.approx(needs - available, abs=0.02)
    actor_gib = float(re.search(r"model actor \(weights\+grads\+adam\): ([\d.]+) GiB", message).group(1))
    assert actor_gib == pytest.approx(params["actor"] * 16 / mem.GiB, abs=0.01)


# ---------------------------------------------------------------------------- pass failures


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
    return graph, initial_plan(graph, "grpo", cfg)


def test_crashing_plugin_pass_is_named() -> None:
    def boom(ctx: Any, plan: ExecutionPlan) -> ExecutionPlan:
        raise RuntimeError("kaboom")

    reg = _registry_with(boom)
    assert reg.entry("passes", "fake_pass").plugin == "fake"
    graph, p0 = _grpo(reg)
    with pytest.raises(PlanError) as info:
        run_passes(graph, p0, reg, passes=(*DEFAULT_PIPELINE, "fake_pass"), emit=lambda _: None)
    assert "pass 'fake_pass' crashed: RuntimeError: kaboom" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_pass_returning_a_non_plan() -> None:
    reg = _registry_with(lambda ctx, plan: {"not": "a plan"})
    graph, p0 = _grpo(reg)
    with pytest.raises(PlanError, match="pass 'fake_pass' returned dict, not an ExecutionPlan"):
        run_passes(graph, p0, reg, passes=(*DEFAULT_PIPELINE, "fake_pass"), emit=lambda _: None)


def test_pass_breaking_an_invariant_is_caught_after_it() -> None:
    def drop_node(ctx: Any, plan: ExecutionPlan) -> ExecutionPlan:
        return msgspec.structs.replace(plan, nodes=plan.nodes[1:])

    reg = _registry_with(drop_node)
    graph, p0 = _grpo(reg)
    with pytest.raises(PlanError, match="after pass 'fake_pass': plan covers nodes"):
        run_passes(graph, p0, reg, passes=(*DEFAULT_PIPELINE, "fake_pass"), emit=lambda _: None)


def test_flowrl_error_in_a_pass_keeps_its_type_and_gets_the_pass_name() -> None:
    def refuse(ctx: Any, plan: ExecutionPlan) -> ExecutionPlan:
        raise TaskError("no such thing")

    reg = _registry_with(refuse)
    graph, p0 = _grpo(reg)
    with pytest.raises(TaskError, match="^pass 'fake_pass': no such thing$"):
        run_passes(graph, p0, reg, passes=("fake_pass",), emit=lambda _: None)


def test_unknown_pass_name_in_the_pipeline(registry: Registry) -> None:
    graph, p0 = _grpo(registry)
    with pytest.raises(PluginError, match="'memroy'. Did you mean 'memory'"):
        run_passes(graph, p0, registry, passes=("resolve", "memroy"), emit=lambda _: None)


def test_invalid_device_is_refused_by_place(registry: Registry) -> None:
    graph, cfg = api.load("grpo", registry=registry, overrides=[*SMALL, "device=tpu"])
    with pytest.raises(PlanError, match="pass 'place'.*config field 'device' is 'tpu'"):
        run_passes(graph, initial_plan(graph, "grpo", cfg), registry, emit=lambda _: None)


# ---------------------------------------------------------------------------- resolve errors


def _graph(reward_fn: str = "task", compute_fn: str = "grpo", compute_reads: str = "rewards responses", compute_writes: str = "advantages", loss: str = "ppo") -> Graph:
    g = Graph("custom")
    g.model("actor", "actor")
    g.generate("rollout", model="actor", n=2)
    g.forward("old_logprobs", model="actor", output="logprobs", reads="responses", writes="old_logprobs")
    g.reward("reward", fn=reward_fn)
    g.compute("adv", fn=compute_fn, reads=compute_reads, writes=compute_writes)
    g.train("train_actor", model="actor", loss=loss, reads="responses old_logprobs advantages")
    return g.verify()


def _resolve(graph: Graph, registry: Registry, **config: Any) -> ExecutionPlan:
    cfg = build_config({"rollout": {"prompts_per_step": 2, "samples_per_prompt": 2}}, config)
    return run_passes(graph, initial_plan(graph, "custom.py", cfg), registry, emit=lambda _: None)


def test_custom_graph_plans(registry: Registry) -> None:
    p = _resolve(_graph(), registry)
    assert p.graph.source == "custom.py" and p.passes == DEFAULT_PIPELINE


def test_unknown_reward_function(registry: Registry) -> None:
    with pytest.raises(FlowRLError) as info:
        _resolve(_graph(reward_fn="taks"), registry)
    message = str(info.value)
    assert message.startswith("pass 'resolve': ")
    assert "unknown reward function 'taks'" in message and "Did you mean 'task'?" in message


def test_unknown_loss(registry: Registry) -> None:
    with pytest.raises(FlowRLError) as info:
        _resolve(_graph(loss="ppo2"), registry)
    assert "pass 'resolve'" in str(info.value) and "'ppo2'" in str(info.value) and "Did you mean 'ppo'?" in str(info.value)


def test_unknown_compute_function(registry: Registry) -> None:
    with pytest.raises(FlowRLError, match="unknown advantage estimator 'grpoo'"):
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
    with pytest.raises(PlanError, match="node 'adv' writes key 'returns', but compute function 'grpo' only produces advantages"):
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
    with pytest.raises(PlanError, match="node 'train_actor': loss 'value' trains on values, but model 'actor' \\(role actor\\) produces logprobs"):
        _resolve(g.verify(), registry)


def test_unknown_task(registry: Registry) -> None:
    with pytest.raises(TaskError, match="pass 'resolve'.*unknown task 'ad'"):
        _resolve(_graph(), registry, task="ad")
