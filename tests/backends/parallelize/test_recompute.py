"""Recomputation (`parallelize.recompute`): every decoder layer recomputes its activations in the
backward, with the same gradients; a model that cannot is refused by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flowrl.backends.local.parallelize import recompute
from flowrl.errors import BackendError


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    module.train()
    ids = torch.randint(3, 20, (2, 6), generator=torch.Generator().manual_seed(0))
    module(input_ids=ids).logits.float().pow(2).mean().backward()
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def test_every_decoder_layer_recomputes_with_the_same_gradients(tiny):
    plain, again = tiny(), tiny()
    recompute.apply(again, "actor")
    assert all(layer.gradient_checkpointing for layer in again.model.layers)
    want, got = _grads(plain), _grads(again)
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)


def test_a_value_model_recomputes_its_backbone(tiny):
    module = tiny(scalar_head=True)
    recompute.apply(module, "critic")
    assert all(layer.gradient_checkpointing for layer in module.backbone.layers)


def test_a_model_that_cannot_recompute_is_refused_by_name():
    with pytest.raises(BackendError, match=r"model 'odd' \(Linear\) cannot recompute"):
        recompute.apply(nn.Linear(2, 2), "odd")
