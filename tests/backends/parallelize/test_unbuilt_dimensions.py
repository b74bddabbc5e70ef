"""`parallelize` refuses the mesh dimensions no module under the parallelize home applies yet (context,
expert), naming the model and the dimension, and pipeline stages a model cannot be cut into, before it
builds a process group; and a model whose sizes do not multiply to its group is refused by name before
any module is touched."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from flowrl.backends.local.parallelize import ParallelDims, ParallelSpec, parallelize
from flowrl.errors import BackendError
from flowrl.specs import LoraConfig

CPU = torch.device("cpu")


def _spec(lora=None) -> ParallelSpec:
    run = SimpleNamespace(
        numerics=SimpleNamespace(dtype="float32", attention="eager", recompute=False), lora=lora, seed=0
    )
    return ParallelSpec.of(SimpleNamespace(name="critic", trainable=True), run)


@pytest.mark.parametrize(
    ("dims", "named"),
    [
        (ParallelDims(model="critic", world=2, context=2), "context (2)"),
        (ParallelDims(model="critic", world=2, data=2, expert=2), "expert (2)"),
    ],
)
def test_a_dimension_no_module_applies_is_refused_naming_the_model_before_any_group_is_made(tiny, dims, named):
    # no torch.distributed group exists in this process: a mesh built first would fail otherwise
    refusal = rf"model 'critic': the torch engine does not split models by {re.escape(named)} yet"
    with pytest.raises(BackendError, match=refusal):
        parallelize(tiny(), dims, _spec(), device=CPU)


def test_a_tensor_size_that_does_not_divide_the_group_names_the_model():
    with pytest.raises(BackendError, match="model 'critic': tensor 2 x pipeline 1 does not divide its group of 3"):
        ParallelDims.of("critic", 3, tensor=2)


def test_a_refused_pipeline_leaves_the_module_as_it_was(tiny):
    """Refusals come before any transform: no adapters on a module that is then refused (the tiny model's
    2 decoder layers cannot make 4 stages)."""
    module = tiny()
    with pytest.raises(
        BackendError, match=r"model 'critic' has 2 decoder layers, fewer than its 4 x 1 pipeline stages"
    ):
        parallelize(module, ParallelDims(model="critic", world=4, pipeline=4), _spec(LoraConfig(rank=2)), device=CPU)
    assert not any(".lora_" in n for n, _ in module.named_parameters())
    assert len(module.backbone.layers if hasattr(module, "backbone") else module.model.layers) == 2
