"""The torch engine's factories (registered as engine "local"): a graph model's module built or copied,
made ready by `flowrl.backends.local.parallelize` over the engine context's ranks, then handed to a
`LocalModel`, which trains, computes and generates over it."""

from __future__ import annotations

import copy
from typing import Any

import msgspec
import torch
from torch import nn

from flowrl.backends.local.engine import LocalModel, LoraBase
from flowrl.backends.local.models import (
    ValueModel,
    build_causal_lm,
    build_model,
    load_tokenizer,
    model_config,
    same_tokenizer,
)
from flowrl.backends.local.parallelize import ParallelDims, ParallelSpec, parallelize
from flowrl.backends.local.threads import _computes
from flowrl.contract.protocols import EngineContext
from flowrl.contract.resolved import ModelRun
from flowrl.errors import BackendError
from flowrl.graph.ir import ModelDecl


def local_model(
    decl: ModelDecl,
    module: nn.Module,
    tokenizer: Any,
    hf_config: Any,
    spec: ModelRun,
    device: torch.device,
    rank: int = 0,
    world: int = 1,
    group: Any = None,
    offload: bool = False,
    tp: int = 1,
    pp: int = 1,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
) -> LocalModel:
    """A `LocalModel` over ``module`` made ready for rank ``rank`` of ``world`` ranks of ``group``, split
    ``tp`` ways tensor-parallel and into ``pp`` pipeline ranks (``virtual_stages`` stages each, run by
    ``schedule``), data parallel over the rest; ``offload``: optimizer states in host memory."""
    dims = ParallelDims.of(decl.name, world, rank, tensor=tp, pipeline=pp)
    pspec = ParallelSpec.of(decl, spec, offload, schedule, virtual_stages)
    ready = parallelize(module, dims, pspec, device=device, group=group, hf_config=hf_config)
    return LocalModel(decl, ready, tokenizer, hf_config, spec, device)


@_computes
def training_engine(ctx: EngineContext) -> LocalModel:
    """A graph model in this process: its checkpoint folder (or a fresh tiny model), or a copy of
    the model it initialises from when that starts from the same folder, with a scalar head for
    critic/reward/cost roles (`build_model`: a trained head when the folder has one). A scalar-head
    model whose folder's tokenizer differs from its source's re-tokenises the rows' text."""
    spec, source = ctx.spec, ctx.source
    writer = None  # the tokenizer of the rows this model reads, when it is not the model's own
    if source is not None and getattr(getattr(source, "spec", None), "checkpoint", None) != spec.checkpoint:
        writer, source = source.tokenizer, None  # a folder of its own (--model NAME=DIR)
    if source is None:
        trust = ctx.trust_remote_code
        tokenizer = load_tokenizer(spec.checkpoint, trust_remote_code=trust)
        hf_config = model_config(spec.checkpoint, spec.tiny, tokenizer, trust_remote_code=trust)
        module = build_model(
            spec.checkpoint, hf_config, spec.seed, ctx.decl.scalar_head, ctx.decl.name, trust_remote_code=trust,
            head_bias=ctx.decl.role == "critic",
        )  # fmt: skip
    elif _is_lora_base(ctx, source):
        return LoraBase(ctx.decl, source, spec)
    else:
        tokenizer, hf_config = source.tokenizer, source.hf_config
        lm = _lm_copy(source)
        # a reward or cost model's head has no bias, as an HF classifier's `score` (it saves as one)
        module = ValueModel(lm, bias=ctx.decl.role == "critic") if ctx.decl.scalar_head else lm
    engine = local_model(
        ctx.decl, module, tokenizer, hf_config, spec, torch.device(ctx.device), ctx.rank, ctx.world, ctx.group,
        offload=ctx.offload, tp=ctx.tp, pp=ctx.pp, schedule=ctx.schedule, virtual_stages=ctx.virtual_stages,
    )  # fmt: skip
    if writer is not None and not same_tokenizer(writer, tokenizer):
        if not ctx.decl.scalar_head or ctx.decl.role == "critic":
            raise BackendError(
                f"model '{ctx.decl.name}' (role {ctx.decl.role}): the tokenizer in '{spec.checkpoint}' differs from "
                f"that of '{ctx.decl.init_from}', whose tokens it reads; its per-token outputs would not line up with "
                "them. Give it a folder with the same tokenizer (a reward or cost model may differ: it re-tokenises "
                "the text)."
            )
        engine.text_tokenizer = writer
    return engine


@_computes
def generation_engine(ctx: EngineContext) -> LocalModel:
    """Generation on a separate local copy of the training engine's model (when another
    training engine trains it, or it samples in another layout); weights arrive through
    `load_weights` after each step. With ``ctx.tp`` > 1 the copy is split tensor-parallel over the
    ``ctx.world`` ranks of ``ctx.group`` (one generation replica), each rank its slice of the weights."""
    source = ctx.source
    module = build_causal_lm(None, source.hf_config, ctx.spec.seed)
    engine = local_model(
        msgspec.structs.replace(ctx.decl, trainable=False),
        module,
        source.tokenizer,
        source.hf_config,
        msgspec.structs.replace(ctx.spec, optimizer=None),
        torch.device(ctx.device),
        ctx.rank,
        ctx.world,
        ctx.group,
        tp=ctx.tp,
    )
    engine.load_weights(source.export_weights(), source.version)
    return engine


def _is_lora_base(ctx: EngineContext, source: Any) -> bool:
    """Whether the model is a frozen LM initialised from a LoRA-trained model of this process (one rank):
    the trained model's base, held once (`LoraBase`)."""
    return (
        isinstance(source, LocalModel)
        and source.lora is not None
        and not ctx.decl.trainable
        and not ctx.decl.scalar_head
        and ctx.world == 1
        and source.world == 1
        and torch.device(ctx.device) == source.device
    )


def _lm_copy(source: Any) -> nn.Module:
    """A copy of ``source``'s causal LM: a LoRA-trained one as a plain model holding its merged weights."""
    module = getattr(source, "module", None)
    if not isinstance(module, nn.Module):
        raise BackendError(
            f"model '{source.decl.name}' is held by another engine; the local training engine copies only local models."
        )
    if isinstance(module, ValueModel):
        raise BackendError("a model cannot initialise from a critic/reward model (it has no LM head).")
    if getattr(source, "lora", None) is not None:
        plain = build_causal_lm(None, source.hf_config, source.spec.seed)
        plain.load_state_dict(source.export_weights())
        return plain.to(source.device)
    return copy.deepcopy(module)
