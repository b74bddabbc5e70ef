"""Recomputation (activation checkpointing): each decoder layer's activations are recomputed in the
backward pass instead of kept (transformers' non-reentrant checkpointing, per layer)."""

from __future__ import annotations

from torch import nn

from flowrl.errors import BackendError


def apply(module: nn.Module, name: str = "") -> None:
    """Recompute every decoder layer of ``module`` (a causal LM or a `ValueModel` around one) in the
    backward pass; a model that cannot is refused by name."""
    lm = getattr(module, "backbone", None) or module
    if not getattr(lm, "supports_gradient_checkpointing", False):
        raise BackendError(
            f"model '{name}' ({type(lm).__name__}) cannot recompute its layers' activations; set train.recompute=false."
        )
    lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
