"""The ``memory`` pass: the breakdown per device group, and plans refused for memory with numbers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from pass_helpers import QUIET, SMALL, activations, local_plan, plan, states_of

from flowrl import api
from flowrl.contract.checked import gib
from flowrl.errors import PlanError
from flowrl.planner import memory as mem
from flowrl.planner.manager import run_passes
from flowrl.planner.passes import PIPELINE, PlanContext
from flowrl.planner.passes import memory as memory_pass
from flowrl.plugins.manager import Registry


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
            transients[n.node] = activations(p, model, n.micro_batch_size, training=n.kind == "train", graph=graph)
    peaks = [k for k in est.breakdown if k.startswith("peak: node ")]
    assert len(peaks) == 1
    assert est.breakdown[peaks[0]] == max(transients.values())
    assert peaks[0].startswith(f"peak: node {max(transients, key=transients.__getitem__)} ")


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
    assert items[0] == f"{biggest}: {gib(est.breakdown[biggest])}"  # the biggest item first
    assert len(items) == len(est.breakdown)
    assert f"needs {gib(est.required_bytes)} per device" in message
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
