"""Mixed precision and numerics (`parallelize.precision`): the attention kernel, FSDP2's bfloat16
policy with float32 reduction, and bfloat16 autocast for a model FSDP2 does not cast."""

from __future__ import annotations

import contextlib

import pytest
import torch

from flowrl.backends.local.parallelize import precision
from flowrl.errors import BackendError


def test_the_attention_kernel_is_set_on_the_model_and_a_value_models_backbone(tiny):
    lm, critic = tiny(), tiny(scalar_head=True)
    precision.set_attention(lm, "sdpa", "actor")
    precision.set_attention(critic, "sdpa", "critic")
    assert lm.config._attn_implementation == "sdpa"
    assert critic.backbone.config._attn_implementation == "sdpa"


def test_an_attention_kernel_not_available_here_is_refused_by_model(tiny):
    with pytest.raises(BackendError, match=r"model 'actor': train.attention=no_such_kernel is not available"):
        precision.set_attention(tiny(), "no_such_kernel", "actor")


def test_fsdp_computes_bfloat16_and_reduces_float32_and_float32_needs_no_policy():
    assert precision.fsdp_policy("float32") is None
    policy = precision.fsdp_policy("bfloat16")
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)


def test_autocast_computes_in_bfloat16_only_when_enabled():
    x = torch.ones(2, 2)
    with precision.autocast(True, torch.device("cpu")):
        assert (x @ x).dtype == torch.bfloat16
    assert isinstance(precision.autocast(False, torch.device("cpu")), contextlib.nullcontext)
