"""ProcessGroupMesh with ColossalAI's methods: ravel/unravel, groups along an axis at indices."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.distributed as dist

from colossal.core import ProcessGroupMesh
from colossal.core.comm import all_reduce
from colossal.core.testing import distributed_test


def test_ravel_unravel_are_inverse_and_match_numpy() -> None:
    """Catches: column-major order, an off-by-one in either direction, wrap/clip that do not
    fold an index as numpy.ravel_multi_index does."""
    shape = (2, 3, 4)
    for rank in range(24):
        coord = ProcessGroupMesh.unravel(rank, shape)
        assert coord == tuple(int(i) for i in np.unravel_index(rank, shape))
        assert ProcessGroupMesh.ravel(coord, shape) == rank
    for coord in itertools.product(range(-2, 4), range(-1, 5), range(5)):
        for mode in ("wrap", "clip"):
            expected = int(np.ravel_multi_index(coord, shape, mode=mode))
            assert ProcessGroupMesh.ravel(coord, shape, mode) == expected
    with pytest.raises(ValueError, match=r"\(0, 3, 0\) is outside shape \(2, 3, 4\)"):
        ProcessGroupMesh.ravel((0, 3, 0), shape)
    with pytest.raises(ValueError, match="mode='fold'"):
        ProcessGroupMesh.ravel((0, 0, 0), shape, "fold")
    with pytest.raises(ValueError, match="rank 24 is outside"):
        ProcessGroupMesh.unravel(24, shape)


def test_get_coords_along_axis() -> None:
    """Catches: indices put on the wrong axis, several axes not combined as a product."""
    assert ProcessGroupMesh.get_coords_along_axis((1, 0, 2), 1, [0, 2]) == [(1, 0, 2), (1, 2, 2)]
    coords = ProcessGroupMesh.get_coords_along_axis((0, 0, 0), [0, 2], [[1], [0, 3]])
    assert coords == [(1, 0, 0), (1, 0, 3)]


def _ranks(mesh: ProcessGroupMesh, group: dist.ProcessGroup | None) -> list[int] | None:
    if group is None or group is dist.GroupMember.NON_GROUP_MEMBER:
        return None
    return mesh.get_ranks_in_group(group)


def _sum_of_ranks(group: dist.ProcessGroup) -> int:
    t = torch.tensor([float(dist.get_rank())])
    all_reduce(t, group=group)
    return int(t.item())


@distributed_test(4)
def test_groups_along_axis_at_indices(rank: int, world_size: int) -> None:
    """Catches: a group with the wrong ranks, a member handed a non-member marker (or the
    reverse), groups created in a different order on different ranks (a hang), a new group
    where a cached one exists."""
    mesh = ProcessGroupMesh(2, 2)  # ColossalAI's form: unnamed axes
    tp = mesh.create_group_along_axis(1)
    assert _ranks(mesh, tp) == [2 * (rank // 2), 2 * (rank // 2) + 1]
    assert mesh.get_group_along_axis(1) is tp and mesh.get_group_along_axis(1, [0, 1]) is tp
    dp = mesh.get_group_along_axis(0, indices_at_axis=[0, 1])
    assert _ranks(mesh, dp) == [rank % 2, rank % 2 + 2] and _sum_of_ranks(dp) == 2 * (rank % 2) + 2
    # both axes, only column 1: ranks 1 and 3
    col1 = mesh.create_group_along_axis([0, 1], [[0, 1], [1]])
    assert _ranks(mesh, col1) == ([1, 3] if rank % 2 else None)

    line = ProcessGroupMesh(4, axis_names=("pp",))
    ends = line.get_group_along_axis("pp", indices_at_axis=[0, 3])
    if rank in (0, 3):
        assert _ranks(line, ends) == [0, 3] and _sum_of_ranks(ends) == 3
    else:
        assert ends is dist.GroupMember.NON_GROUP_MEMBER
    assert line.create_group_along_axis(0, [0, 3]) is (ends if rank in (0, 3) else None)
    with pytest.raises(ValueError, match=r"\[4\] outside axis 0 of extent 4"):
        line.get_group_along_axis(0, [0, 4])
    line.destroy_mesh_process_groups()
