"""The ``place`` pass: the plan of this machine (one device, every model colocated) and the model
states it sizes."""

from __future__ import annotations

import pytest
from pass_helpers import plan, trainable

from flowrl.backends.local import device as local_device
from flowrl.backends.local.executor import LOCAL_NUMERICS
from flowrl.contract.model import from_tiny
from flowrl.planner import memory as mem
from flowrl.planner.space import DeviceGroup, GenerationLayout, Parallel
from flowrl.plugins.manager import Registry
from flowrl.specs import RunConfig
from flowrl.tasks.tokenizer import vocab


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
    from flowrl.backends.local.models import ValueModel

    with torch.device("meta"):
        built = sum(t.numel() for t in AutoModelForCausalLM.from_config(hf).parameters())
        # a critic: the decoder with a scalar head in place of the LM head
        valued = sum(t.numel() for t in ValueModel(AutoModelForCausalLM.from_config(hf)).parameters())
    params = p.target.model.parameters()
    assert params == built  # the planner's count is the model the local engines build
    assert p.target.model.with_head(True).parameters() == valued < built
    assert trainable(graph) == {"actor", "critic"}
    breakdown = p.memory[0].breakdown
    # fp32 weights (4) + grads (4) + two AdamW moments (8) per trainable parameter, weights alone otherwise
    assert breakdown["model actor (weights+grads+optimizer)"] == params * 16
    assert breakdown["model critic (weights+grads+optimizer)"] == valued * 16
    assert breakdown["model ref (weights)"] == params * 4
    assert p.target.cluster.hardware.memory_bytes == 2 * mem.GiB
    assert p.config.threads == 3
