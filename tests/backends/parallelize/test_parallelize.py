"""`parallelize`: one model made ready in one order from its spec -- what a frozen model skips, what one
process does around the module (autocast, host optimizer states), LoRA refused with tensor parallelism
before anything is split."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flowrl.backends.local.parallelize import ParallelDims, ParallelSpec, parallelize
from flowrl.errors import BackendError
from flowrl.specs import LoraConfig

CPU = torch.device("cpu")


def _run(dtype="float32", recompute=True, lora=None):
    numerics = SimpleNamespace(dtype=dtype, attention="sdpa", recompute=recompute)
    return SimpleNamespace(numerics=numerics, lora=lora, seed=0)


def test_a_frozen_model_takes_no_adapters_recomputes_nothing_and_offloads_nothing():
    spec = ParallelSpec.of(SimpleNamespace(name="ref", trainable=False), _run(lora=LoraConfig(rank=4)), offload=True)
    assert (spec.trainable, spec.lora, spec.recompute, spec.offload) == (False, None, False, False)


def test_one_process_in_bfloat16_computes_under_autocast_and_is_not_distributed(tiny):
    spec = ParallelSpec.of(SimpleNamespace(name="actor", trainable=True), _run("bfloat16"), offload=True)
    ready = parallelize(tiny(), ParallelDims.of("actor", 1), spec, device=CPU)
    assert ready.autocast and not ready.sharded and not ready.distributed
    assert not ready.host_optimizer  # on the host already: nothing to move
    assert all(layer.gradient_checkpointing for layer in ready.module.model.layers)
    assert ready.module.config._attn_implementation == "sdpa"


def test_float32_computes_as_the_weights_are(tiny):
    spec = ParallelSpec.of(SimpleNamespace(name="actor", trainable=True), _run(recompute=False))
    ready = parallelize(tiny(), ParallelDims.of("actor", 1), spec, device=CPU)
    assert not ready.autocast
    assert not any(getattr(layer, "gradient_checkpointing", False) for layer in ready.module.model.layers)


def test_lora_adapters_come_first_and_only_they_train(tiny):
    spec = ParallelSpec.of(SimpleNamespace(name="actor", trainable=True), _run(lora=LoraConfig(rank=2)))
    ready = parallelize(tiny(), ParallelDims.of("actor", 1), spec, device=CPU)
    assert any(".lora_A" in n for n, _ in ready.module.named_parameters())


def test_lora_with_tensor_parallelism_is_refused_before_anything_is_split(tiny):
    spec = ParallelSpec.of(SimpleNamespace(name="actor", trainable=True), _run(lora=LoraConfig(rank=2)))
    module = tiny()
    with pytest.raises(BackendError, match="does not split tensor-parallel"):
        parallelize(module, ParallelDims.of("actor", 2, tensor=2), spec, device=CPU)
    assert not any(".lora_" in n for n, _ in module.named_parameters())
