"""FSDP2 (``fully_shard``) over a model's data-parallel ranks: each decoder layer one unit, the rest
(embeddings, norms, head) the root -- as torchtitan's ``apply_fsdp`` does.

Parameters stay gathered from a forward until the backward after it (``reshard_after_forward=False``):
a forward-only loop (scoring) gathers once, and a train step gathers once per mini-batch (gradients are
reduced at its last micro-step). Mixed precision and host offload are policies handed in
(`precision.fsdp_policy`, `offload.fsdp_policy`).
"""

from __future__ import annotations

from typing import Any

from torch import nn


def decoder_layers(module: nn.Module) -> list[nn.Module]:
    """``module``'s decoder layers (the first ``...layers`` ModuleList; a `ValueModel`'s backbone's; a
    pipeline stage's `pipeline.StageLayers`)."""
    found = next(
        (
            m
            for n, m in module.named_modules()
            if n.endswith("layers") and (isinstance(m, nn.ModuleList) or getattr(m, "decoder_stage", False))
        ),
        (),
    )
    return list(found)


def apply(module: nn.Module, mesh: Any, mp_policy: Any = None, offload_policy: Any = None) -> None:
    """Shard ``module`` over ``mesh`` (the data dimension) in place: every decoder layer, then the root."""
    from torch.distributed.fsdp import fully_shard

    kwargs: dict[str, Any] = {}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if offload_policy is not None:
        kwargs["offload_policy"] = offload_policy
        module.to("cpu")  # the shards live in host memory
    for layer in decoder_layers(module):
        fully_shard(layer, mesh=mesh, reshard_after_forward=False, **kwargs)
    fully_shard(module, mesh=mesh, reshard_after_forward=False, **kwargs)
