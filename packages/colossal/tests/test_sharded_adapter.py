"""FSDP2's DTensors reach checkpoint IO as colossal.core.ShardedTensor (DTensorShard)."""

from __future__ import annotations

import pytest
import torch

from colossal.checkpoint_io.sharded import DTensorShard, as_sharded
from colossal.core import Block, CommTracker, FlatRange, LocalShard, Replicated, ShardedTensor
from colossal.core.testing import distributed_test


def _full(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float32).reshape(shape) - 3


@distributed_test(2)
def test_dtensor_shards_gather_to_a_named_rank(rank: int, world_size: int) -> None:
    # Catches: a block computed unlike torch's split (uneven sizes, an empty last rank, a dim
    # other than 0), a gather that reaches every rank, or wrap() losing the layout.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    cases = [((5, 3), Shard(0)), ((1, 4), Shard(0)), ((3, 5), Shard(1)), ((2, 2), Replicate())]
    for shape, placement in cases:
        full = _full(shape)
        tensor = distribute_tensor(full, mesh, [placement])
        shard = as_sharded(tensor)
        assert isinstance(shard, DTensorShard) and isinstance(shard, ShardedTensor)
        assert shard.shape == full.shape and isinstance(shard.part, Block)
        assert torch.equal(shard.part.take(full), shard.local()), (shape, placement)
        for dst in range(world_size):
            with CommTracker() as tracker:
                got = shard.gather(dst)
            if rank == dst:
                assert got is not None and torch.equal(got, full), (shape, placement, dst)
            else:
                assert got is None and tracker.calls("recv") == 0
        everywhere = shard.gather(None)
        assert everywhere is not None and torch.equal(everywhere, full)
        rebuilt = shard.wrap(shard.local() * 2)
        assert rebuilt.placements == tensor.placements
        assert torch.equal(rebuilt.full_tensor(), full * 2)
    with pytest.raises(ValueError, match="dst=9"):
        as_sharded(distribute_tensor(_full((4, 2)), mesh, [Shard(0)])).gather(9)
    from torch.distributed.tensor import DTensor, Partial

    partial = DTensor.from_local(_full((4, 2)), mesh, [Partial()], run_check=False)
    with pytest.raises(NotImplementedError, match="placements"):
        as_sharded(partial)


@distributed_test(4)
def test_dtensor_on_a_2d_mesh_gathers_axis_by_axis(rank: int, world_size: int) -> None:
    """A 2 x 2 mesh: each mesh dimension is one placement; the gather walks both axes
    (catches a leader chosen inconsistently across the groups of an axis, which would hang
    or deliver a tensor to the wrong rank, and nested Shard(0) x Shard(0) laid out wrong)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for placements in ([Shard(0), Shard(1)], [Shard(0), Shard(0)], [Replicate(), Shard(1)]):
        full = _full((6, 5))
        shard = as_sharded(distribute_tensor(full, mesh, placements))
        assert [p.axis for p in shard.placements] == ["dp", "tp"]
        assert torch.equal(shard.part.take(full), shard.local()), placements
        for dst in range(world_size):
            got = shard.gather(dst)
            if rank == dst:
                assert got is not None and torch.equal(got, full), (placements, dst)
            else:
                assert got is None


def test_as_sharded_wraps_plain_tensors_and_passes_sharded_ones() -> None:
    full = _full((2, 3))
    assert isinstance(as_sharded(full), Replicated) and as_sharded(full).local() is full
    shard = LocalShard(full.reshape(-1)[:4], FlatRange(0, 4), full.shape)
    assert as_sharded(shard) is shard
    with pytest.raises(TypeError, match="ShardedTensor"):
        as_sharded([1.0, 2.0])
