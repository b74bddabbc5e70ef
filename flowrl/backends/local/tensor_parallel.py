"""Tensor parallelism moved to `flowrl.backends.local.parallelize.tensor`; its names stay importable here."""

from flowrl.backends.local.parallelize.tensor import (  # noqa: F401
    LAYER_PLAN,
    check_splits,
    clip_grad_norm,
    distribute_like,
    load_local_shards,
    load_whole,
    local,
    local_shards,
    mesh,
    parallelize,
    sharded_optimizer_state,
    token_logprobs,
)
