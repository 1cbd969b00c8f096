"""ProcessGroupMesh: membership along each axis, by index and by name."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from colossal.core import ProcessGroupMesh
from colossal.core.comm import all_reduce
from colossal.core.testing import distributed_test


def _sum_of_ranks(group: dist.ProcessGroup) -> int:
    t = torch.tensor([float(dist.get_rank())])
    all_reduce(t, group=group)
    return int(t.item())


@distributed_test(4)
def test_mesh_2x2(rank: int, world_size: int) -> None:
    mesh = ProcessGroupMesh(2, 2, axis_names=("dp", "tp"))
    assert mesh.coordinate() == (rank // 2, rank % 2)
    assert mesh.coordinate("dp") == rank // 2 and mesh.coordinate(1) == rank % 2
    tp = mesh.get_group_along_axis("tp")
    dp = mesh.get_group_along_axis(0)
    expected_tp = [2 * (rank // 2), 2 * (rank // 2) + 1]
    expected_dp = [rank % 2, rank % 2 + 2]
    assert mesh.get_ranks_in_group(tp) == expected_tp
    assert mesh.get_ranks_in_group(dp) == expected_dp
    # The groups really communicate among exactly those ranks.
    assert _sum_of_ranks(tp) == sum(expected_tp)
    assert _sum_of_ranks(dp) == sum(expected_dp)
    # Cached: asking again returns the same object and creates nothing new.
    assert mesh.get_group_along_axis("tp") is tp
    both = mesh.get_group_along_axis(("dp", "tp"))
    assert mesh.get_ranks_in_group(both) == [0, 1, 2, 3]
    assert mesh.all_groups_along_axis("tp") == [[0, 1], [2, 3]]
    assert mesh.all_groups_along_axis("dp") == [[0, 2], [1, 3]]


@distributed_test(4)
def test_mesh_2x2x1(rank: int, world_size: int) -> None:
    mesh = ProcessGroupMesh(2, 2, 1, axis_names=("pp", "dp", "tp"))
    assert mesh.coordinate() == (rank // 2, rank % 2, 0)
    assert mesh.get_ranks_in_group(mesh.get_group_along_axis("tp")) == [rank]
    assert mesh.get_ranks_in_group(mesh.get_group_along_axis("pp")) == [rank % 2, rank % 2 + 2]
    dp_tp = mesh.get_group_along_axis(["dp", "tp"])
    assert mesh.get_ranks_in_group(dp_tp) == [2 * (rank // 2), 2 * (rank // 2) + 1]
    assert _sum_of_ranks(dp_tp) == 4 * (rank // 2) + 1
    assert mesh.size("pp") == 2 and mesh.size() == (2, 2, 1)


@distributed_test(4)
def test_mesh_2x2x1_dp_alone_by_name_and_index(rank: int, world_size: int) -> None:
    from colossal.core.comm import all_gather, broadcast

    mesh = ProcessGroupMesh(2, 2, 1, axis_names=("pp", "dp", "tp"))
    dp = mesh.get_group_along_axis("dp")
    expected_dp = [2 * (rank // 2), 2 * (rank // 2) + 1]
    assert mesh.get_ranks_in_group(dp) == expected_dp
    assert mesh.all_groups_along_axis("dp") == [[0, 1], [2, 3]]
    assert _sum_of_ranks(dp) == sum(expected_dp)
    # Index and name address the same cached groups.
    assert mesh.get_group_along_axis(1) is dp
    assert mesh.get_group_along_axis(0) is mesh.get_group_along_axis("pp")
    assert mesh.get_group_along_axis(2) is mesh.get_group_along_axis("tp")
    assert mesh.coordinate(1) == mesh.coordinate("dp") == rank % 2
    # The size-1 axis: a group of this rank alone; collectives over it return the input.
    tp = mesh.get_group_along_axis("tp")
    assert mesh.get_ranks_in_group(tp) == [rank]
    value = torch.arange(3, dtype=torch.float32) + 10 * rank
    reduced = value.clone()
    all_reduce(reduced, group=tp)
    assert torch.equal(reduced, value)
    sent = value.clone()
    broadcast(sent, src=rank, group=tp)
    assert torch.equal(sent, value)
    gathered = torch.full_like(value, -1.0)
    all_gather(gathered, value, group=tp)
    assert torch.equal(gathered, value)


@distributed_test(1, 2)
def test_mesh_one_axis(rank: int, world_size: int) -> None:
    mesh = ProcessGroupMesh(world_size)
    group = mesh.get_group_along_axis(0)
    assert mesh.get_ranks_in_group(group) == list(range(world_size))
    assert _sum_of_ranks(group) == sum(range(world_size))


@distributed_test(4)
def test_mesh_bad_input(rank: int, world_size: int) -> None:
    with pytest.raises(ValueError, match=r"multiply to 6, but the world size is 4"):
        ProcessGroupMesh(2, 3)
    with pytest.raises(ValueError, match="positive ints"):
        ProcessGroupMesh(4, 0)
    with pytest.raises(ValueError, match="unique names"):
        ProcessGroupMesh(2, 2, axis_names=("dp", "dp"))
    mesh = ProcessGroupMesh(2, 2, axis_names=("dp", "tp"))
    with pytest.raises(ValueError, match="unknown mesh axis 'pp'"):
        mesh.get_group_along_axis("pp")
    with pytest.raises(ValueError, match="out of range"):
        mesh.coordinate(2)


def test_ravel_unravel_roundtrip() -> None:
    shape = (2, 3, 4)
    for rank in range(24):
        coord = ProcessGroupMesh.unravel(rank, shape)
        assert ProcessGroupMesh.ravel(coord, shape) == rank
    assert ProcessGroupMesh.unravel(23, shape) == (1, 2, 3)
