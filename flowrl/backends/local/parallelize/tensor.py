"""Tensor parallelism: a model split over the tensor ranks of its device group (DTensor).

A device group of ``dp x tp`` ranks is a 2D mesh, rank ``r`` at (``r // tp``, ``r % tp``): the ranks
of one row hold one copy of the model between them (DTensor, `parallelize_module`) and compute the
same rows; FSDP2 shards each row's parameters over the column (data parallel). Per decoder layer
(Megatron's split, as torchtitan applies it to Llama): the q/k/v and gate/up projections column-wise
(each rank its heads, its slice of the MLP), the o and down projections row-wise (one all-reduce
each); the embedding and the LM head over the vocabulary. The LM head's logits stay sharded: the
log-probs of the sampled tokens are computed from each rank's slice of the vocabulary with three
all-reduces of [B, R] (max, sum of exponentials, the token's logit), never the full vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

LAYER_PLAN = {  # Llama-family decoder layer: column-wise in, row-wise out
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}


def mesh(group: Any, tp: int, device_type: str) -> Any:
    """The (dp, tp) DeviceMesh of ``group``'s ranks: rows of ``tp`` consecutive ranks. Each rank makes
    the two subgroups it is in (locally synchronised: the other ranks of the world take no part)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    ranks = dist.get_process_group_ranks(group)
    grid = torch.tensor(ranks).reshape(-1, tp)
    me = ranks.index(dist.get_rank())
    row, col = grid[me // tp].tolist(), grid[:, me % tp].tolist()
    groups = [dist.new_group(col, use_local_synchronization=True), dist.new_group(row, use_local_synchronization=True)]
    return DeviceMesh.from_group(groups, device_type, mesh=grid, mesh_dim_names=("dp", "tp"))


def check_splits(config: Any, tp: int, name: str) -> None:
    """A model ``tp`` divides: its attention heads, its key/value heads (or they divide tp: each rank then
    holds them whole) and its MLP width. The vocabulary need not divide: its slices are torch.chunk's."""
    from flowrl.errors import BackendError

    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": _kv_heads(config),
        "intermediate_size": config.intermediate_size,
    }
    if tp % sizes["num_key_value_heads"] == 0:  # fewer key/value heads than ranks: every rank holds them whole
        sizes.pop("num_key_value_heads")
    bad = {k: v for k, v in sizes.items() if v % tp}
    if bad:
        raise BackendError(
            f"model '{name}' cannot be split tp {tp}: {', '.join(f'{k} {v}' for k, v in bad.items())} "
            f"not divisible by {tp}. Plan it with a tp that divides them (--require {name}.tp=N)."
        )


def parallelize(module: nn.Module, tp_mesh: Any) -> None:
    """Split ``module`` (a causal LM, or a `ValueModel` around one) over ``tp_mesh`` in place: every
    decoder layer as `LAYER_PLAN`, the embedding over the vocabulary, and the LM head column-wise with
    its logits left sharded over the vocabulary (a DTensor: `token_logprobs` reads them so). The
    norms and a scalar head stay whole on every rank (replicated)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    base = getattr(module, "backbone", None) or module.base_model
    head = getattr(module, "lm_head", None)
    tied = head is not None and head.weight is base.embed_tokens.weight
    # fewer key/value heads than ranks (multi-query, or grouped-query with kv_heads < tp): the key/value
    # projections stay whole on every rank, which keeps the one head its query heads read; their
    # gradient is the sum of the ranks' parts
    tp, kv = tp_mesh.size(), _kv_heads(module.config)
    whole_kv = kv < tp
    plan = {k: v for k, v in LAYER_PLAN.items() if not (whole_kv and k in ("self_attn.k_proj", "self_attn.v_proj"))}
    group = tp_mesh.get_group()
    for layer in base.layers:
        parallelize_module(layer, tp_mesh, {k: styles[v]() for k, v in plan.items()})
        if whole_kv:
            attn = layer.self_attn
            attn.num_key_value_groups = module.config.num_attention_heads // tp  # this rank's heads, one KV head
            kv_head = tp_mesh.get_local_rank() * kv // tp  # the key/value head this rank's query heads read
            width = attn.head_dim
            for proj in (attn.k_proj, attn.v_proj):
                proj.register_forward_hook(
                    lambda _m, _i, out, at=kv_head * width: _GradSummed.apply(out, group)[..., at : at + width]
                )
    parallelize_module(base, tp_mesh, {"embed_tokens": RowwiseParallel(input_layouts=Replicate())})
    if head is not None:
        out = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        parallelize_module(module, tp_mesh, {"lm_head": out})
        if tied:  # both sharded over the vocabulary (dim 0): one parameter again, as before the split
            module.lm_head.weight = base.embed_tokens.weight


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: float) -> Tensor:
    """log softmax(logits / temperature) at ``tokens`` (float32, the shape of ``tokens``); ``logits``
    [..., V], or a DTensor sharded over its last dimension (the vocabulary), whose slices are reduced
    over their tp group without gathering the vocabulary (differentiable: a train step backpropagates
    through the all-reduces)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(logits, DTensor):
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)
        return logp.gather(-1, tokens[..., None]).squeeze(-1)
    import torch.distributed as dist

    group = logits.device_mesh.get_group()
    local = logits.to_local().float() / temperature  # [..., V / tp]
    width = local.shape[-1]
    # DTensor shards as torch.chunk does: ceil(V / tp) a rank, the last ones fewer when tp does not divide V
    start = dist.get_group_rank(group, dist.get_rank()) * -(-logits.shape[-1] // logits.device_mesh.size())
    top = local.detach().amax(dim=-1)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)  # a constant: shifts cancel in the gradient
    sumexp = _Summed.apply((local - top[..., None]).exp().sum(-1), group)
    here = (tokens >= start) & (tokens < start + width)
    picked = local.gather(-1, (tokens - start).clamp(0, width - 1)[..., None]).squeeze(-1) * here
    chosen = _Summed.apply(picked, group)  # the token's logit, from the rank holding it
    return chosen - top - sumexp.log()


def local_shards(module: nn.Module) -> dict[str, Tensor]:
    """This rank's tensor-parallel slice of every tensor of ``module``'s state dict, on the host: its
    tp slice as its tp mesh holds it, gathered over the data-parallel dimension (FSDP2 shards) where
    the model has one; a tensor held whole, whole. What a generation engine of the same tp layout on
    the same ranks loads (`load_local_shards`): no rank holds the whole model."""
    from torch.distributed.tensor import DTensor, Replicate

    out = {}
    for name, t in module.state_dict().items():
        if isinstance(t, DTensor):  # gathered over the dp dimension of its mesh, kept as sliced over tp
            names = t.device_mesh.mesh_dim_names or ()
            placements = [Replicate() if n == "dp" else pl for n, pl in zip(names, t.placements)]
            if placements != list(t.placements):
                t = t.redistribute(t.device_mesh, placements)
            t = t.to_local()
        out[name] = t.detach().to("cpu", copy=True)
    return out


def load_local_shards(module: nn.Module, shards: dict[str, Tensor]) -> None:
    """Copy ``shards`` (`local_shards` of a model split the same way) into ``module``'s own slices, in place."""
    with torch.no_grad():
        for name, t in module.state_dict().items():
            local(t).copy_(shards[name])


def distribute_like(whole: Tensor, like: Tensor) -> Tensor:
    """``whole`` (the same on every rank) held as ``like`` is held: for a DTensor, one of its mesh and
    placements -- tp slices, FSDP2 shards, both (a strided shard) -- each rank cutting its own piece
    without communication; a plain tensor, ``whole`` itself. (torch's full-state-dict loaders cannot
    cut FSDP2 shards of tp slices.)"""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(like, DTensor):
        return whole
    mesh = like.device_mesh
    held = DTensor.from_local(whole.to(like.device, like.dtype), mesh, [Replicate()] * mesh.ndim, run_check=False)
    return held.redistribute(mesh, like.placements)


def load_whole(module: nn.Module, weights: dict[str, Tensor]) -> None:
    """Copy the whole tensors ``weights`` (some or all of ``module``'s state dict, by name) into the
    pieces of them ``module`` holds on this rank, in place."""
    with torch.no_grad():
        for name, t in module.state_dict().items():
            if name in weights:
                piece = distribute_like(weights[name], t)
                local(t).copy_(local(piece))


def sharded_optimizer_state(module: nn.Module, whole: dict[str, Any]) -> dict[str, Any]:
    """A whole optimizer state dict (`get_optimizer_state_dict(full_state_dict=True)`: by parameter name)
    with each per-parameter tensor held as its parameter is (`distribute_like`), for
    `set_optimizer_state_dict(full_state_dict=False)`."""
    params = dict(module.named_parameters())
    state = {}
    for name, entry in whole["state"].items():
        p = params.get(name)
        state[name] = {
            k: distribute_like(v, p) if isinstance(v, Tensor) and p is not None and v.shape == p.shape else v
            for k, v in entry.items()
        }
    return {**whole, "state": state}


def full(tensor: Tensor) -> Tensor:
    """A DTensor whole (gathered over its mesh: every rank of it calls this); a plain tensor itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def local(tensor: Tensor) -> Tensor:
    """A DTensor's piece on this rank; a plain tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _kv_heads(config: Any) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


class _GradSummed(torch.autograd.Function):
    """Itself forward; backward, the sum of its gradient over a tp group's ranks: a tensor every rank
    computes whole (a shared key/value head) whose uses are split over the ranks (their query heads)."""

    @staticmethod
    def forward(ctx: Any, whole: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return whole.view_as(whole)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        import torch.distributed as dist

        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None


class _Summed(torch.autograd.Function):
    """The sum of a tensor over a tp group's ranks. Every rank then computes the same loss from it, so
    a rank's own part gets that loss's gradient as it is (no all-reduce backward: that would count
    the one loss tp times)."""

    @staticmethod
    def forward(ctx: Any, part: Tensor, group: Any) -> Tensor:
        import torch.distributed as dist

        total = part.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def clip_grad_norm(
    params: list[nn.Parameter], max_norm: float, across: Any = None, uncounted: tuple[nn.Parameter, ...] = ()
) -> Tensor:
    """`torch.nn.utils.clip_grad_norm_` for parameters that are DTensors over several meshes (tp
    slices, FSDP shards) and plain tensors: each gradient's squared norm from its local part, summed
    over the mesh dimensions it is sharded on (replicated ones count once), and over the process group
    ``across`` (pipeline stages: each holds other parameters); every rank clips by the same global
    norm, which it returns. ``uncounted`` (among ``params``) are clipped but not counted: a copy of a
    weight another rank counts (a tied LM head's on the last pipeline stage)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    sums: dict[tuple[Any, ...], Tensor] = {}
    grads = [p.grad for p in params if p.grad is not None]
    skip = {id(p.grad) for p in uncounted if p.grad is not None}
    for g in grads:
        if id(g) in skip:
            continue
        if isinstance(g, DTensor):
            key = tuple(g.device_mesh.get_group(d) for d, pl in enumerate(g.placements) if pl.is_shard())
            local = g.to_local()
        else:
            key, local = (), g
        square = local.float().pow(2).sum()
        sums[key] = sums[key] + square if key in sums else square
    total = torch.zeros((), dtype=torch.float32)
    for groups, value in sums.items():
        for group in groups:
            dist.all_reduce(value, group=group)
        total = total + value.cpu()
    if across is not None:
        dist.all_reduce(total, group=across)
    norm = total.sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        (g.to_local() if isinstance(g, DTensor) else g).mul_(scale.to(g.device))
    return norm
