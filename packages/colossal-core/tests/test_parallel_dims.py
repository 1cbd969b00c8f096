"""ParallelDims: validation, the rank layout of each axis order, and the groups it hands out."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from colossal.core import ParallelDims
from colossal.core.comm import all_reduce
from colossal.core.testing import distributed_test

# ---- validation (no process group needed) ----------------------------------------------------


def test_product_error_names_every_size_the_product_and_the_world() -> None:
    with pytest.raises(ValueError) as err:
        ParallelDims(dp=2, pp=3, tp=2, sp=1, world_size=8)
    msg = str(err.value)
    for part in ("dp=2", "pp=3", "tp=2", "sp=1", "multiply to 12", "world size is 8"):
        assert part in msg, (part, msg)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"dp": 0}, "dp=0"),
        ({"tp": -2}, "tp=-2"),
        ({"pp": 1.5}, "pp=1.5"),
        ({"sp": True}, "sp=True"),
        ({"dp_shard": 0}, "dp_shard=0"),
    ],
)
def test_sizes_must_be_positive_ints(kwargs: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        ParallelDims(world_size=4, **kwargs)


def test_dp_is_inferred_and_dp_shard_must_divide_it() -> None:
    dims = ParallelDims(tp=2, world_size=8)
    assert (dims.dp, dims.dp_shard, dims.dp_replicate) == (4, 4, 1)
    with pytest.raises(ValueError, match="cannot infer dp.*= 3.*world size 8"):
        ParallelDims(pp=3, world_size=8)
    with pytest.raises(ValueError, match="dp_shard=3 must divide dp=4"):
        ParallelDims(dp=4, dp_shard=3, world_size=4)
    hsdp = ParallelDims(dp=4, dp_shard=2, world_size=4)
    assert hsdp.dp_replicate == 2 and hsdp.dp_replicate_enabled and hsdp.dp_shard_enabled


@pytest.mark.parametrize(
    "order", [("dp", "pp", "tp"), ("dp", "pp", "tp", "tp"), ("dp", "pp", "sp", "ep"), "dpspt"]
)
def test_bad_order_names_the_axes(order: object) -> None:
    with pytest.raises(ValueError) as err:
        ParallelDims(world_size=1, order=order)  # type: ignore[arg-type]
    assert "('dp', 'pp', 'sp', 'tp')" in str(err.value) and repr(order) in str(err.value)


def test_unknown_group_name_lists_the_names() -> None:
    dims = ParallelDims(dp=2, tp=2, world_size=4)
    with pytest.raises(ValueError, match="'cp'.*'dp', 'dp_replicate', 'dp_shard'"):
        dims.ranks("cp", rank=0)
    with pytest.raises(ValueError, match="twice"):
        dims.ranks(("dp", "dp_shard"), rank=0)


def test_frozen_and_flags() -> None:
    dims = ParallelDims(dp=2, pp=2, world_size=4)
    with pytest.raises(AttributeError):
        dims.dp = 4  # type: ignore[misc]
    assert dims.dp_enabled and dims.pp_enabled and not dims.tp_enabled and not dims.sp_enabled
    assert dims == ParallelDims(dp=2, pp=2, world_size=4)
    assert dims.mesh_axes == ("dp_replicate", "dp_shard", "pp", "sp", "tp")
    assert dims.mesh_shape == (1, 2, 2, 1, 1)


# ---- layout (arithmetic, no process group) -------------------------------------------------

# (sizes, order, axis) -> groups of that axis at world 4, listed by rank 0..3.
LAYOUTS = [
    ({"dp": 2, "tp": 2}, None, "tp", [[0, 1], [0, 1], [2, 3], [2, 3]]),
    ({"dp": 2, "tp": 2}, None, "dp", [[0, 2], [1, 3], [0, 2], [1, 3]]),
    ({"dp": 2, "tp": 2}, ("tp", "pp", "sp", "dp"), "dp", [[0, 1], [0, 1], [2, 3], [2, 3]]),
    ({"dp": 2, "tp": 2}, ("tp", "pp", "sp", "dp"), "tp", [[0, 2], [1, 3], [0, 2], [1, 3]]),
    ({"dp": 2, "pp": 2}, None, "pp", [[0, 1], [0, 1], [2, 3], [2, 3]]),
    ({"dp": 2, "pp": 2}, None, "dp", [[0, 2], [1, 3], [0, 2], [1, 3]]),
    ({"dp": 2, "pp": 2}, ("pp", "dp", "sp", "tp"), "pp", [[0, 2], [1, 3], [0, 2], [1, 3]]),
    ({"dp": 2, "pp": 2}, ("pp", "dp", "sp", "tp"), "dp", [[0, 1], [0, 1], [2, 3], [2, 3]]),
    ({"dp": 4, "dp_shard": 2}, None, "dp_shard", [[0, 1], [0, 1], [2, 3], [2, 3]]),
    ({"dp": 4, "dp_shard": 2}, None, "dp_replicate", [[0, 2], [1, 3], [0, 2], [1, 3]]),
    ({"dp": 4, "dp_shard": 2}, None, "dp", [[0, 1, 2, 3]] * 4),
]


@pytest.mark.parametrize(("sizes", "order", "axis", "expected"), LAYOUTS)
def test_ranks_along_each_axis_follow_the_order(
    sizes: dict, order: tuple[str, ...] | None, axis: str, expected: list[list[int]]
) -> None:
    dims = ParallelDims(world_size=4, **sizes, **({"order": order} if order else {}))
    assert [dims.ranks(axis, rank=r) for r in range(4)] == expected
    assert [dims.coordinate(axis, rank=r) for r in range(4)] == [
        expected[r].index(r) for r in range(4)
    ]


def test_combined_axes_at_world_8() -> None:
    dims = ParallelDims(dp=2, sp=2, tp=2, world_size=8)  # rank = 4 dp + 2 sp + tp
    assert dims.ranks(("dp", "sp"), rank=0) == [0, 2, 4, 6]
    assert dims.ranks(("sp", "dp"), rank=5) == [1, 3, 5, 7]
    assert dims.ranks(("sp", "tp"), rank=5) == [4, 5, 6, 7]
    assert dims.coordinate(("dp", "sp"), rank=6) == 3
    assert dims.size(("dp", "sp")) == 4


# ---- groups (spawned gloo) --------------------------------------------------------------------


def _members_and_sum(group: dist.ProcessGroup) -> tuple[list[int], int]:
    t = torch.tensor([float(dist.get_rank())])
    all_reduce(t, group=group)
    return dist.get_process_group_ranks(group), int(t.item())


@distributed_test(4)
def test_groups_at_world_4(rank: int, world_size: int) -> None:
    for sizes, order, axis, expected in LAYOUTS:
        dims = ParallelDims(**sizes, **({"order": order} if order else {}))
        group = dims.group(axis)
        members, total = _members_and_sum(group)
        # The group really holds, and communicates among, exactly the expected ranks.
        assert members == expected[rank] and total == sum(expected[rank]), (sizes, order, axis)
        assert dist.get_rank(group) == dims.coordinate(axis)
        assert dims.group(axis) is group  # built once
        dims.destroy()
    # Combined axes: ZeRO over dp x sp, and a combination equal to one axis is its group.
    dims = ParallelDims(dp=2, sp=2)
    assert dims.group(("dp", "sp")) is dist.group.WORLD  # the whole job: no new group
    assert _members_and_sum(dims.group("sp"))[0] == [2 * (rank // 2), 2 * (rank // 2) + 1]
    dims = ParallelDims(dp=2, pp=2)
    dp = dims.group("dp")
    assert dims.group(("dp", "tp")) is dp and dims.group(("dp_shard", "sp")) is dp
    assert dims.build_mesh() is dims.build_mesh()
    dims.destroy()


@distributed_test(1)
def test_world_1(rank: int, world_size: int) -> None:
    dims = ParallelDims()
    assert (dims.dp, dims.pp, dims.tp, dims.sp, dims.world_size) == (1, 1, 1, 1, 1)
    assert not (dims.dp_enabled or dims.pp_enabled or dims.tp_enabled or dims.sp_enabled)
    for axis in ("dp", "tp", "pp", "sp", ("dp", "sp")):
        assert dims.group(axis) is dist.group.WORLD
        assert dims.coordinate(axis) == 0
    assert dims._mesh is None  # nothing to create at world 1
    with pytest.raises(ValueError, match=r"dp=2, pp=1, tp=1, sp=1 multiply to 2.*world size is 1"):
        ParallelDims(dp=2)
    with pytest.raises(ValueError, match="describes 2 ranks but the job has 1"):
        ParallelDims(dp=2, world_size=2).group("dp")


@distributed_test(2)
def test_data_parallel_over_a_given_group(rank: int, world_size: int) -> None:
    whole = ParallelDims.data_parallel()
    assert whole.dp == 2 and whole.group("dp") is dist.group.WORLD
    singles = [dist.new_group([r]) for r in range(world_size)]
    mine = singles[rank]
    dims = ParallelDims.data_parallel(group=mine)
    assert (dims.dp, dims.world_size) == (1, 1)
    assert dims.group("dp") is mine and dims.group("dp_shard") is mine
    assert dims.ranks("dp") == [rank] and dims.coordinate("dp") == 0
    pair = ParallelDims.data_parallel(group=dist.new_group([0, 1]))
    assert pair.dp == 2 and pair.ranks("dp") == [0, 1]
    assert pair.group("dp") is pair.dp_group and pair.group(("dp", "tp")) is pair.dp_group
    with pytest.raises(ValueError, match="builds no mesh"):
        pair.build_mesh()
    with pytest.raises(ValueError, match="can only hand out that group"):
        ParallelDims(dp=2, dp_shard=1, dp_group=pair.dp_group).group("dp_shard")
    with pytest.raises(ValueError, match="pp=2"):
        ParallelDims(pp=2, dp_group=mine)
    with pytest.raises(ValueError, match="dp=2 differs from the size 1"):
        ParallelDims(dp=2, dp_group=mine)


# ---- tensor-parallel grids (2D, 2.5D, 3D) -----------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp": 8, "tp_mode": "2d"}, r"tp=8 is not a square; use tp=4, 9"),
        ({"tp": 8, "tp_mode": "2.5d", "tp_depth": 3}, r"tp=8 is not tp_depth=3 times a square"),
        ({"tp": 4, "tp_mode": "3d"}, r"tp=4 is not a cube; use tp=8, 27"),
        ({"tp": 4, "tp_mode": "4d"}, r"tp_mode='4d' is not one of"),
        ({"tp": 4, "tp_depth": 2}, r"tp_depth=2 applies to tp_mode='2.5d' only"),
    ],
)
def test_tp_grid_sizes_are_validated(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelDims(world_size=8, **kwargs)


def test_tp_grid_ranks() -> None:
    # 2D at world 8 (dp 2 x 2x2 grid): tp rank l = 2*row + col inside each block of 4.
    dims = ParallelDims(dp=2, tp=4, tp_mode="2d", world_size=8)
    assert dims.tp_grid_shape == (2, 2)
    assert dims.ranks("tp_row", rank=5) == [4, 5]  # the row of rank 5: same row, each column
    assert dims.ranks("tp_col", rank=5) == [5, 7]
    assert dims.ranks("tp", rank=5) == [4, 5, 6, 7]  # the grid as a whole is still tp
    assert dims.coordinate("tp_row", rank=5) == 1 and dims.coordinate("tp_col", rank=5) == 0
    # 2.5D, depth 2 of a 2x2 grid: depth outermost; xz = depth x row.
    dims = ParallelDims(tp=8, tp_mode="2.5d", tp_depth=2, world_size=8)
    assert dims.tp_grid_shape == (2, 2, 2)
    assert dims.ranks("tp_dep", rank=1) == [1, 5]
    assert dims.ranks(("tp_dep", "tp_row"), rank=0) == [0, 1, 4, 5]
    # 3D cube: input innermost, output outermost.
    dims = ParallelDims(tp=8, tp_mode="3d", world_size=8)
    assert dims.ranks("tp_input", rank=0) == [0, 1]
    assert dims.ranks("tp_weight", rank=0) == [0, 2]
    assert dims.ranks("tp_output", rank=0) == [0, 4]
    assert dims.size(("tp_input", "tp_weight")) == 4
    with pytest.raises(ValueError, match=r"'tp_row' exists only with tp_mode in \['2d', '2.5d'\]"):
        ParallelDims(tp=2, world_size=2).ranks("tp_row", rank=0)


@distributed_test(4)
def test_tp_grid_groups_at_world_4(rank: int, world_size: int) -> None:
    dims = ParallelDims(tp=4, tp_mode="2d")
    for axis in ("tp_row", "tp_col"):
        members, total = _members_and_sum(dims.group(axis))
        assert members == dims.ranks(axis) and total == sum(members), axis
        assert dist.get_rank(dims.group(axis)) == dims.coordinate(axis)
    assert dims.group("tp") is dist.group.WORLD
    dims.destroy()
