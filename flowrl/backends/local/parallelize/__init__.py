"""One home for parallelism in the torch engine, torchtitan-style: one device mesh per model
(`mesh.ParallelDims`, `mesh.build_mesh`) and `parallelize`, which applies every transform to a model's
module, per decoder layer, in one order. A new parallelism is one module here plus its tests.

The order, and why (each step needs what the ones before it left):

1. **LoRA** (`lora`): adapters are new parameters of their decoder layers, so they come before anything
   splits the layers (the torch engine refuses LoRA with tensor parallelism).
2. **Tensor parallelism** (`tensor`): each decoder layer's projections become DTensor slices over the
   tensor mesh (Megatron's split), the embedding and LM head over the vocabulary.
3. **Pipeline stages** (`pipeline`): the tensor-sliced (LoRA'd) model is cut to this rank's stages --
   contiguous decoder layers, the embeddings on the first stage, the final norm and head on the last
   -- over the pipeline ranks (outermost: stage rank ``r // (dp x tp)``); FSDP2 then shards each
   stage over its pipeline rank's data ranks, and the engine runs train steps and forward passes
   through torch.distributed.pipelining's schedules (GPipe, 1F1B, interleaved 1F1B).
   An LM head tied to the embeddings becomes a copy on the last stage whose gradient is summed with
   the first stage's (`pipeline.TiedWeight`, as Megatron does).
4. **Recomputation** (`recompute`): each decoder layer recomputes its activations in the backward.
5. **Numerics** (`precision.set_attention`): the attention kernel.
6. **FSDP2** (`fsdp`): a trainable model over several data ranks is sharded per decoder layer and at
   the root, with mixed precision (`precision.fsdp_policy`) and host offload (`offload.fsdp_policy`)
   as its policies.
7. **Mixed precision in one process** (`precision.autocast`) and **optimizer offload in one process**
   (`offload.host_step`): what FSDP2 does not do for a model, the engine does per pass and per step;
   `Parallelized` says which. A LoRA model's frozen base weights are then stored in bfloat16
   (`lora.store_base`: autocast computes them so anyway, and would cast them again at every pass).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import torch
from torch import nn

from flowrl.backends.local.parallelize import fsdp, lora, offload, pipeline, precision, recompute, tensor
from flowrl.backends.local.parallelize.mesh import Mesh, ParallelDims, build_mesh
from flowrl.specs import LoraConfig

__all__ = ["Mesh", "ParallelDims", "ParallelSpec", "Parallelized", "build_mesh", "parallelize"]


class ParallelSpec(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """What `parallelize` applies to one model, from its resolved spec: the model's ``name`` (for
    messages), whether it ``trainable``, its ``lora`` adapters (None: none), the precision it computes
    in (``dtype``: float32 or bfloat16), its ``attention`` kernel, ``recompute``, and ``offload`` (the
    optimizer states in host memory between steps), ``seed`` (LoRA's initial adapters)."""

    name: str
    trainable: bool = False
    lora: LoraConfig | None = None
    dtype: str = "float32"
    attention: str = "eager"
    recompute: bool = False
    offload: bool = False
    seed: int = 0
    schedule: str = "1f1b"  # with pipeline stages: the schedule (pipeline.SCHEDULES)
    virtual_stages: int = 1  # stages per pipeline rank (interleaved)

    @classmethod
    def of(
        cls, decl: Any, run: Any, offload: bool = False, schedule: str = "1f1b", virtual_stages: int = 1
    ) -> ParallelSpec:
        """The spec of graph model ``decl`` resolved as ``run`` (a `ModelRun`); ``offload``, ``schedule``
        and ``virtual_stages`` from its layout. A frozen model takes no adapters, recomputes nothing and
        offloads nothing."""
        numerics = run.numerics
        trainable = bool(decl.trainable)
        return cls(
            name=decl.name,
            trainable=trainable,
            lora=run.lora if trainable else None,
            dtype=numerics.dtype,
            attention=numerics.attention,
            recompute=bool(numerics.recompute and trainable),
            offload=bool(offload and trainable),
            seed=run.seed,
            schedule=schedule,
            virtual_stages=virtual_stages,
        )


@dataclass(frozen=True)
class Parallelized:
    """A module `parallelize` made ready, and what the engine must do around it: ``autocast`` (forward
    passes under bfloat16 autocast), ``host_optimizer`` (optimizer states to host memory between steps),
    ``sharded`` (FSDP2 shards it over ``dims.data`` ranks), ``distributed`` (its weights are DTensors:
    whole state dicts are gathered), ``pipeline`` (its stages on this rank and how they run; None: no
    stages)."""

    module: nn.Module
    dims: ParallelDims
    spec: ParallelSpec
    mesh: Mesh
    sharded: bool
    distributed: bool
    autocast: bool
    host_optimizer: bool
    pipeline: pipeline.Pipeline | None = None


def parallelize(
    module: nn.Module,
    dims: ParallelDims,
    spec: ParallelSpec,
    *,
    device: torch.device,
    group: Any = None,
    hf_config: Any = None,
) -> Parallelized:
    """Apply LoRA, tensor parallelism, (pipeline stages), recomputation, the attention kernel, FSDP2,
    mixed precision and offload to ``module`` on ``device``, in that order (the module docstring), over
    ``group``'s ranks as ``dims`` split them. ``hf_config``: the model's HF config (tensor parallelism
    checks that it splits)."""
    # every refusal before the module changes: what cannot be built leaves the caller's module as it was
    dims.check_built()
    lora.check_split(spec.lora, dims.tensor, spec.name)
    if dims.tensor > 1:
        tensor.check_splits(hf_config if hf_config is not None else module.config, dims.tensor, spec.name)
    if dims.pipeline > 1:
        pipeline.check_split(module, dims.pipeline, spec.virtual_stages, spec.schedule, spec.name)
    module = module.to(device)
    if spec.lora is not None:
        lora.add_lora(module, spec.lora, spec.seed, spec.name)
    grid = build_mesh(dims, group, device.type, spec.trainable)
    if grid.tensor is not None:
        tensor.parallelize(module, grid.tensor)
    stages: list[pipeline.Stage] = []
    tied = None
    if dims.pipeline > 1:  # this rank's stages of the tensor-sliced module, before FSDP2 wraps their layers
        names = pipeline.tied_names(module)
        stages = pipeline.split(module, dims.pipeline_index, dims.pipeline, spec.virtual_stages)
        if names is not None:  # the first rank holds the embedding, the last its copy as the head
            at = {0: names[0], dims.pipeline - 1: names[1]}.get(dims.pipeline_index)
            group = pipeline.tie_group(grid.pipeline, dims.pipeline, dims.pipeline_index)
            tied = pipeline.TiedWeight(embedding=names[0], head=names[1], name=at, group=group)
    if spec.recompute:
        recompute.apply(module, spec.name)
    precision.set_attention(module, spec.attention, spec.name)
    sharded = dims.sharded(spec.trainable)
    if sharded:
        policy = offload.fsdp_policy(device) if spec.offload else None
        for part in stages or [module]:  # each stage is a root of its own (its forward is what runs)
            fsdp.apply(part, grid.data, precision.fsdp_policy(spec.dtype), policy)
    half = precision.half(spec.dtype)
    if spec.lora is not None and half and not sharded:  # autocast computes the frozen base in bfloat16 anyway
        lora.store_base(module, torch.bfloat16)
    staged = None
    if stages:
        staged = pipeline.Pipeline(
            stages=stages,
            group=grid.pipeline,
            pp=dims.pipeline,
            index=dims.pipeline_index,
            virtual=spec.virtual_stages,
            schedule=spec.schedule,
            device=device,
            hidden=int(module.config.hidden_size),
            act_dtype=None if half else torch.float32,  # bfloat16: torch infers what passes between stages
            tied=tied,
        )
    return Parallelized(
        module=module,
        dims=dims,
        spec=spec,
        mesh=grid,
        sharded=sharded,
        distributed=dims.distributed(spec.trainable),
        autocast=half and not sharded,
        host_optimizer=spec.offload and not sharded and device.type != "cpu",
        pipeline=staged,
    )
