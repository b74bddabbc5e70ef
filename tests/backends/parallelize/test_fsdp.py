"""FSDP2 (`parallelize.fsdp`): each decoder layer one unit, then the root; sharding itself runs over
two gloo ranks in test_fsdp_sharded.py and the tensor-parallel tests."""

from __future__ import annotations

from torch import nn

from flowrl.backends.local.parallelize import fsdp


def test_the_units_are_the_decoder_layers_of_a_model_or_of_a_value_models_backbone(tiny):
    lm, critic = tiny(), tiny(scalar_head=True)
    assert fsdp.decoder_layers(lm) == list(lm.model.layers)
    assert fsdp.decoder_layers(critic) == list(critic.backbone.layers)
    assert len(fsdp.decoder_layers(lm)) == lm.config.num_hidden_layers


def test_a_module_without_decoder_layers_has_no_units():
    assert fsdp.decoder_layers(nn.Linear(2, 2)) == []
