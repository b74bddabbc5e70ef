"""One device mesh per model, from the engine's context (torchtitan's ``ParallelDims``, our own).

A model's device group of ``world`` ranks is split into ``pipeline x data x context x tensor``
ranks (expert parallelism, when a model has experts, folds into the data x tensor ranks), the
pipeline outermost: rank ``r`` is pipeline rank (stage) ``r // (data x context x tensor)``, at data
row ``r // (context x tensor) % data`` and tensor column ``r % tensor`` (the ranks of one row hold
one copy of the model between them -- its stages over the pipeline ranks, its slices over the tensor
ranks -- and compute the same rows). ``data``, ``tensor`` and ``pipeline`` are built; ``context``
and ``expert`` above 1 are refused by name until a module under `flowrl.backends.local.parallelize`
applies them.

`ParallelDims` is pure (no torch.distributed); `build_mesh` makes the process groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from flowrl.errors import BackendError


class ParallelDims(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """How a model's ``world`` ranks split: ``data`` (FSDP2 shards when the model trains) x ``tensor``
    (DTensor slices) x ``pipeline`` (stages) x ``context`` (sequence slices); ``expert`` divides the
    data x context x tensor ranks. ``rank``: this rank's place among the ``world``. ``model``: the
    graph model's name, for messages."""

    model: str = ""
    world: int = 1
    rank: int = 0
    data: int = 1
    tensor: int = 1
    pipeline: int = 1
    context: int = 1
    expert: int = 1

    def __post_init__(self) -> None:
        where = f"model '{self.model}'"
        sizes = {
            "world": self.world,
            "data": self.data,
            "tensor": self.tensor,
            "pipeline": self.pipeline,
            "context": self.context,
            "expert": self.expert,
        }
        bad = {k: v for k, v in sizes.items() if v < 1}
        if bad:
            raise BackendError(f"{where}: parallel sizes must be at least 1; got {bad}.")
        product = self.data * self.tensor * self.pipeline * self.context
        if product != self.world:
            raise BackendError(
                f"{where}: data {self.data} x tensor {self.tensor} x pipeline {self.pipeline} x context "
                f"{self.context} = {product} ranks, but its device group has {self.world}. Plan a layout whose "
                "sizes multiply to the group's ranks."
            )
        if (self.data * self.context * self.tensor) % self.expert:
            raise BackendError(
                f"{where}: expert {self.expert} does not divide data x context x tensor "
                f"({self.data * self.context * self.tensor})."
            )
        if not 0 <= self.rank < self.world:
            raise BackendError(f"{where}: rank {self.rank} is outside its group of {self.world}.")

    @classmethod
    def of(cls, model: str, world: int, rank: int = 0, tensor: int = 1, pipeline: int = 1) -> ParallelDims:
        """The dims of a group of ``world`` ranks split ``tensor`` x ``pipeline`` ways, data parallel
        over the rest; a ``tensor`` that does not divide ``world`` is refused by name."""
        if tensor < 1 or pipeline < 1 or world % (tensor * pipeline):
            raise BackendError(
                f"model '{model}': tensor {tensor} x pipeline {pipeline} does not divide its group of {world} ranks."
            )
        return cls(model=model, world=world, rank=rank, tensor=tensor, pipeline=pipeline,
                   data=world // (tensor * pipeline))  # fmt: skip

    @property
    def data_index(self) -> int:
        """Which data shard this rank computes (its row of the mesh)."""
        return self.rank // (self.tensor * self.context) % self.data

    @property
    def tensor_index(self) -> int:
        return self.rank % self.tensor

    @property
    def pipeline_index(self) -> int:
        """Which pipeline rank this rank is (its stages: `pipeline.stages_of`)."""
        return self.rank // (self.data * self.context * self.tensor)

    def sharded(self, trainable: bool) -> bool:
        """Whether FSDP2 shards the model: a trainable model over several data ranks (a frozen one keeps
        a full replica per data rank and scores its shard of the rows)."""
        return trainable and self.data > 1

    def distributed(self, trainable: bool) -> bool:
        """Whether the model's weights are DTensors (FSDP2 shards, tensor slices) or in pipeline stages
        (no rank holds them all): whole state dicts are gathered, and one rank cannot split a micro-batch
        that ran out of memory on its own."""
        return self.sharded(trainable) or self.tensor > 1 or self.pipeline > 1

    def check_built(self) -> None:
        """Refuse the dimensions no module applies yet, naming them."""
        todo = {k: v for k, v in (("context", self.context), ("expert", self.expert))}
        todo = {k: v for k, v in todo.items() if v > 1}
        if todo:
            raise BackendError(
                f"model '{self.model}': the torch engine does not split models by "
                f"{', '.join(f'{k} ({v})' for k, v in todo.items())} yet. Plan it with those sizes at 1."
            )


@dataclass(frozen=True)
class Mesh:
    """The device meshes a model is split over: ``data`` (FSDP2; None: not sharded) and ``tensor``
    (DTensor slices; None: whole) -- both dimensions of one 2D mesh when both exist, the mesh of this
    rank's pipeline rank when the model is in stages -- and ``pipeline``, the process group of the
    ranks at this rank's (data, tensor) place in every pipeline rank (None: no stages)."""

    data: Any = None
    tensor: Any = None
    pipeline: Any = None


def build_mesh(dims: ParallelDims, group: Any, device_type: str, trainable: bool) -> Mesh:
    """The meshes of ``dims`` over ``group``'s ranks (collective over the group when it makes subgroups):
    a (data, tensor) mesh when the model is split tensor-parallel, else the group itself as the data
    mesh when FSDP2 shards it, else nothing."""
    dims.check_built()
    if dims.pipeline > 1:
        from flowrl.backends.local.parallelize import pipeline

        made = pipeline.groups(group, dims.pipeline, dims.data, dims.tensor, device_type)
        mesh = made.stage_mesh
        if dims.tensor > 1:
            return Mesh(data=mesh["dp"] if dims.sharded(trainable) else None, tensor=mesh["tp"], pipeline=made.pipeline)
        return Mesh(data=mesh if dims.sharded(trainable) else None, pipeline=made.pipeline)
    if dims.tensor > 1:
        from flowrl.backends.local.parallelize import tensor

        grid = tensor.mesh(group, dims.tensor, device_type)
        return Mesh(data=grid["dp"], tensor=grid["tp"])
    if dims.sharded(trainable):
        from torch.distributed.device_mesh import DeviceMesh

        return Mesh(data=DeviceMesh.from_group(group, device_type))
    return Mesh()
