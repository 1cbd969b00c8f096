"""One placement per parallel axis: composition, axis-by-axis gathers, the one norm.

Expected values come from the whole tensor built in the test, never from the code under
test. What each case catches is in its docstring.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from colossal.core import (
    Absent,
    Block,
    FlatRange,
    LocalShard,
    Nested,
    Owned,
    Placement,
    ProcessGroupMesh,
    Replicate,
    compose,
    grad_norm,
    mark_sharded,
)
from colossal.core.sharded.gather import grid_axes, leader_of
from colossal.core.testing import distributed_test

SHAPE = (5, 3)


def _full() -> torch.Tensor:
    return torch.arange(15, dtype=torch.float32).reshape(SHAPE) + 1


def _tp_then_dp(tp: int, dp: int) -> tuple[Placement, Placement]:
    """tp splits the rows 3 + 2 (the second part padded to 3 rows), dp halves the flat 9."""
    rows = Block.along(SHAPE, 0, 0, 3) if tp == 0 else Block.along(SHAPE, 0, 3, 5)
    flat = FlatRange(0, 5) if dp == 0 else FlatRange(5, 9)
    return Placement("tp", rows, None, (3, 3)), Placement("dp", flat, None)


def _local(tp: int, dp: int) -> torch.Tensor:
    rows, flat = _tp_then_dp(tp, dp)
    padded = torch.zeros(3, 3)
    real = _full()[rows.part.index()]
    padded[: real.shape[0]] = real
    return padded.reshape(-1)[flat.part.start : flat.part.stop]


def test_compose_merges_what_it_can() -> None:
    """Catches replicated/owned levels kept as parts, blocks of blocks left unmerged, and a
    flat range of a whole tensor turned into a nested part."""
    whole = Placement("tp", Replicate())
    rows = Placement("tp", Block.along(SHAPE, 0, 1, 5))
    cols = Placement("ep", Block.along((4, 3), 1, 1, 3))
    assert compose((Placement("pp", Owned(1)), whole), SHAPE) == Block.whole(SHAPE)
    assert compose((rows, cols), SHAPE) == Block((1, 1), (4, 2))
    assert compose((Placement("tp", Block.whole(SHAPE)), Placement("dp", FlatRange(2, 9))),
                   SHAPE) == FlatRange(2, 9)
    nested = compose(_tp_then_dp(1, 0), SHAPE)
    assert isinstance(nested, Nested) and nested.shapes == (SHAPE, (3, 3))


@pytest.mark.parametrize(("tp", "dp"), [(0, 0), (0, 1), (1, 0), (1, 1)])
def test_nested_part_takes_puts_reads_and_drops_padding(tp: int, dp: int) -> None:
    """A flat range of a padded tensor-parallel block: take/read give the held elements with
    the padding zero, real() drops the padding (the norm must never count it), put writes
    only real elements back (catches a flat range taken of the unpadded block, padding
    counted, or padding written into the next row)."""
    part = compose(_tp_then_dp(tp, dp), SHAPE)
    assert isinstance(part, Nested)
    full = _full()
    assert torch.equal(part.take(full), _local(tp, dp))
    assert torch.equal(part.read(lambda index: full if index is None else full[index], SHAPE),
                       _local(tp, dp))
    real = part.real(_local(tp, dp))
    assert real.numel() == (5 if (tp, dp) == (0, 0) else 4 if tp == 0 else
                            5 if dp == 0 else 1)
    assert bool((real != 0).all())
    target = torch.zeros(SHAPE)
    part.put(target, _local(tp, dp))
    assert torch.equal(target[target != 0], full[target != 0])
    assert int((target != 0).sum()) == real.numel()


def test_grid_axes_and_leaders() -> None:
    """Catches a leader chosen at another coordinate than the destination's (a gather would
    end on the wrong rank) and a group that is no grid axis accepted."""
    assert grid_axes([0, 1, 4, 5]) == [(1, 2), (4, 2)]
    assert leader_of([0, 1, 4, 5], 3) == 1 and leader_of([2, 3, 6, 7], 5) == 7
    assert leader_of([0, 2], 5) == 0 and leader_of([1, 3], 5) == 1 and leader_of([1, 3], 7) == 3
    assert grid_axes([1, 2]) is None
    with pytest.raises(ValueError, match="row-major grid"):
        leader_of([1, 2], 0)


def _gathers_everywhere(shard: Any, rank: int, world_size: int) -> None:
    """The whole tensor on each named rank only, and on every rank with dst=None."""
    for dst in range(world_size):
        got = shard.gather(dst)
        assert (got is not None) == (rank == dst)
        if got is not None:
            assert torch.equal(got, _full()), dst
    assert torch.equal(shard.gather(None), _full())


@distributed_test(4)
def test_two_level_gather_reaches_every_destination(rank: int, world_size: int) -> None:
    """tp 2 x dp 2, a flat dp range of a padded tp block: the whole tensor on each named rank
    only, and on every rank with dst=None (catches levels gathered in the wrong order, the
    padding kept, a leader off the destination's coordinate)."""
    mesh = ProcessGroupMesh(2, 2, axis_names=("tp", "dp"))
    tp, dp = mesh.coordinate("tp"), mesh.coordinate("dp")
    rows, flat = _tp_then_dp(tp, dp)
    placements = (Placement("tp", rows.part, mesh.get_group_along_axis("tp"), (3, 3)),
                  Placement("dp", flat.part, mesh.get_group_along_axis("dp")))
    _gathers_everywhere(LocalShard(_local(tp, dp), placements, SHAPE), rank, world_size)


@distributed_test(4)
def test_owned_axis_gathers_from_its_stage(rank: int, world_size: int) -> None:
    """pp 2 x tp 2: stage 1 owns a tensor split over tp; stage 0 joins as Absent. Every rank
    named as destination receives it (catches a stage that is not the owner sending, or a
    destination on the other stage left waiting)."""
    mesh = ProcessGroupMesh(2, 2, axis_names=("pp", "tp"))
    pp, tp = mesh.coordinate("pp"), mesh.coordinate("tp")
    owned = Placement("pp", Owned(1), mesh.get_group_along_axis("pp"))
    if pp == 1:
        rows = Block.along(SHAPE, 0, 0, 3) if tp == 0 else Block.along(SHAPE, 0, 3, 5)
        split = Placement("tp", rows, mesh.get_group_along_axis("tp"))
        shard = LocalShard(rows.take(_full()).clone(), (owned, split), SHAPE)
    else:
        shard = Absent(SHAPE, torch.float32, (owned,))
    _gathers_everywhere(shard, rank, world_size)


@distributed_test(8)
def test_norm_over_a_tensor_split_on_three_axes(rank: int, world_size: int) -> None:
    """a 2 x b 2 x c 2: W (6, 4) is split by rows along a, by columns along b and by a flat
    range along c; B is replicated along all three; U carries no placements (replicated
    over the job). The norm equals the whole model's (catches a replicated tensor counted on
    every rank - 8x its share - a split level not summed, or U counted more than once)."""
    mesh = ProcessGroupMesh(2, 2, 2, axis_names=("a", "b", "c"))
    a, b, c = (mesh.coordinate(n) for n in ("a", "b", "c"))
    group = {n: mesh.get_group_along_axis(n) for n in ("a", "b", "c")}
    g = torch.Generator().manual_seed(3)
    w_grad, b_grad, u_grad = (torch.randn(6, 4, generator=g), torch.randn(5, generator=g),
                              torch.randn(2, 2, generator=g))
    rows = Block.along((6, 4), 0, 3 * a, 3 * a + 3)
    cols = Block.along((3, 4), 1, 2 * b, 2 * b + 2)
    flat = FlatRange(3 * c, 3 * c + 3)
    w = torch.zeros(3)
    w.grad = w_grad[rows.index()][cols.index()].reshape(-1)[flat.start : flat.stop].clone()
    mark_sharded(w, (Placement("a", rows, group["a"]), Placement("b", cols, group["b"]),
                     Placement("c", flat, group["c"])), (6, 4))
    bias = torch.zeros(5)
    bias.grad = b_grad.clone()
    mark_sharded(bias, tuple(Placement(n, Replicate(), group[n]) for n in ("a", "b", "c")),
                 (5,))
    u = torch.zeros(2, 2)
    u.grad = u_grad.clone()
    whole = torch.cat([w_grad.reshape(-1), b_grad, u_grad.reshape(-1)])
    for norm_type in (2.0, math.inf):
        got = float(grad_norm([w, bias, u], norm_type))
        want = float(torch.linalg.vector_norm(whole, norm_type))
        assert got == pytest.approx(want, rel=1e-6), norm_type
