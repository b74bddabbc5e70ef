"""A tiny random Llama (flowrl's character tokenizer, no download) for the parallelize tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from torch import nn

from flowrl.backends.local.models import ValueModel, build_causal_lm, load_tokenizer, tiny_llama_config
from flowrl.specs import TinyModelConfig


@pytest.fixture(scope="module")
def tiny() -> Callable[..., Any]:
    """``tiny(scalar_head=False)``: a fresh tiny causal LM (or a `ValueModel` around one), the same each call."""
    config = tiny_llama_config(TinyModelConfig(), load_tokenizer(None))

    def build(scalar_head: bool = False) -> nn.Module:
        lm = build_causal_lm(None, config, seed=0)
        return ValueModel(lm) if scalar_head else lm

    return build
