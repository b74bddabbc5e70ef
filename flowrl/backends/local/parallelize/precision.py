"""Mixed precision and numerics: the attention kernel, and the precision a model computes in.

Master weights and optimizer states stay float32. A model computing in bfloat16 does so in one of two
ways: sharded by FSDP2, its policy casts the float32 shards to bfloat16 for compute and reduces
gradients in float32 (`fsdp_policy`); in one process (or replicated), forward passes run under
bfloat16 autocast (`autocast`), float32 where autocast keeps it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from flowrl.errors import BackendError


def set_attention(module: nn.Module, attention: str, name: str = "") -> None:
    """Make ``module`` (a causal LM or a `ValueModel`) compute with the ``attention`` kernel (sdpa,
    eager, flash_attention_2); one that is not available here is refused by name."""
    lm = getattr(module, "backbone", None) or module
    try:
        lm.set_attn_implementation(attention)
    except Exception as exc:  # flash-attn missing, or an architecture without that kernel
        raise BackendError(
            f"model '{name}': train.attention={attention} is not available here ({type(exc).__name__}: {exc}). "
            "Use train.attention=sdpa or eager."
        ) from None


def half(dtype: str) -> bool:
    """Whether a resolved ``numerics.dtype`` computes in bfloat16."""
    return dtype == "bfloat16"


def fsdp_policy(dtype: str) -> Any:
    """FSDP2's mixed-precision policy: bfloat16 compute from float32 shards, gradients reduced in
    float32; None (as the weights are) for float32."""
    if not half(dtype):
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def autocast(enabled: bool, device: torch.device) -> Any:
    """The context forward passes run in: bfloat16 autocast when ``enabled`` (a model computing in
    bfloat16 that FSDP2 does not cast), else nothing."""
    if enabled:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
