"""The device mesh's sizes (`parallelize.mesh.ParallelDims`): data x tensor x pipeline x context ranks
multiply to the group's, each rank knows its data shard, and what no module builds yet is refused."""

from __future__ import annotations

import pytest

from flowrl.backends.local.parallelize.mesh import ParallelDims, build_mesh
from flowrl.errors import BackendError


def test_a_group_split_tensor_parallel_is_data_parallel_over_the_rest():
    dims = ParallelDims.of("actor", world=4, rank=3, tensor=2)
    assert (dims.data, dims.tensor, dims.pipeline) == (2, 2, 1)
    assert (dims.data_index, dims.tensor_index) == (1, 1)


@pytest.mark.parametrize(("rank", "shard"), [(0, 0), (1, 0), (2, 1), (5, 2)])
def test_the_ranks_of_one_row_share_a_data_shard(rank, shard):
    assert ParallelDims.of("actor", world=6, rank=rank, tensor=2).data_index == shard


def test_sizes_that_do_not_multiply_to_the_group_are_refused_by_model():
    with pytest.raises(
        BackendError, match=r"model 'actor': data 2 x tensor 2 .* = 4 ranks, but its device group has 6"
    ):
        ParallelDims(model="actor", world=6, data=2, tensor=2)


def test_a_tensor_size_that_does_not_divide_the_group_is_refused():
    with pytest.raises(BackendError, match=r"model 'critic': tensor 4 x pipeline 1 does not divide its group of 6"):
        ParallelDims.of("critic", world=6, tensor=4)


def test_an_expert_size_must_divide_the_dense_ranks():
    with pytest.raises(BackendError, match="expert 3 does not divide"):
        ParallelDims(model="m", world=4, data=4, expert=3)


def test_a_rank_outside_the_group_is_refused():
    with pytest.raises(BackendError, match="rank 2 is outside its group of 2"):
        ParallelDims(model="m", world=2, data=2, rank=2)


def test_only_a_trainable_model_over_several_data_ranks_is_sharded():
    dims = ParallelDims.of("m", world=2)
    assert dims.sharded(True) and not dims.sharded(False)
    assert not ParallelDims.of("m", world=1).distributed(True)
    assert ParallelDims.of("m", world=2, tensor=2).distributed(False)  # tensor slices are DTensors


@pytest.mark.parametrize("size", ["context", "expert"])
def test_dimensions_no_module_builds_yet_are_refused_by_name(size):
    dims = ParallelDims(model="actor", world=2, data=1 if size != "expert" else 2, **{size: 2})
    with pytest.raises(BackendError, match=rf"does not split models by {size} \(2\) yet"):
        build_mesh(dims, None, "cpu", trainable=True)


@pytest.mark.parametrize(("rank", "stage", "shard", "column"), [(0, 0, 0, 0), (3, 0, 1, 1), (4, 1, 0, 0), (7, 1, 1, 1)])
def test_the_pipeline_is_outermost(rank, stage, shard, column):
    """pp2 x dp2 x tp2 over 8 ranks: stage ``r // (dp x tp)``, then data rows, then tensor columns."""
    dims = ParallelDims.of("actor", world=8, rank=rank, tensor=2, pipeline=2)
    assert (dims.pipeline_index, dims.data_index, dims.tensor_index) == (stage, shard, column)
    assert dims.distributed(False)  # no rank holds a model in stages whole


def test_one_rank_builds_no_mesh():
    mesh = build_mesh(ParallelDims.of("m", world=1), None, "cpu", trainable=True)
    assert mesh.data is None and mesh.tensor is None
