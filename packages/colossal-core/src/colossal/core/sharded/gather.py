"""Gathering a tensor described by its placements, one axis at a time.

:func:`gather_placed` starts from what this rank holds and walks the placements from the
innermost to the outermost. At each axis that splits the tensor the ranks of the axis group
assemble the block the level above holds, on one rank of the group only (the *leader*, the
rank at the destination's coordinate along the axis); the others drop out. A replicated axis
moves nothing (its leader already holds the block), an owned axis (a pipeline stage's
tensor) sends the block from its owner to the destination. With ``dst=None`` every rank ends
with the whole tensor.

Groups are expected to be the axes of a row-major grid (``ProcessGroupMesh``, ``DeviceMesh``):
then every group along an axis picks its leader at the same coordinate, so the leaders of
one level are exactly the ranks of the next level's groups that go on, and the chain ends on
the destination. A group that is not such an axis raises instead of guessing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from colossal.core.comm import all_gather_object, broadcast, group_ranks, recv, send
from colossal.core.sharded.parts import Block, Blocks, FlatRange
from colossal.core.sharded.placement import Owned, Placement, Replicate, level_shapes

__all__ = [
    "InnerGather",
    "axis_ranks",
    "gather_level",
    "gather_placed",
    "grid_axes",
    "leader_of",
    "this_rank",
]

InnerGather = Callable[[int | None], torch.Tensor | None]
"""``gather(leader)``: the innermost level gathered to global rank ``leader`` (None: all)."""


def this_rank() -> int:
    """This process' global rank (0 without ``torch.distributed``)."""
    return dist.get_rank() if dist.is_initialized() else 0


def axis_ranks(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    """Global ranks of an axis group in coordinate order (``(0,)`` without distributed)."""
    return tuple(group_ranks(group)) if dist.is_initialized() else (0,)


def grid_axes(ranks: Sequence[int]) -> list[tuple[int, int]] | None:
    """``(stride, size)`` of each grid axis a group spans, innermost first; None if no grid.

    A group along one or several axes of a row-major grid holds ``first + sum(c_k * s_k)``
    for every coordinate ``c_k < n_k``: the strides and sizes are read off the ranks (once
    per group: a save asks for every tensor and level).
    """
    axes = _grid_axes(tuple(ranks))
    return None if axes is None else list(axes)


@functools.lru_cache(maxsize=256)
def _grid_axes(ranks: tuple[int, ...]) -> tuple[tuple[int, int], ...] | None:
    first = min(ranks)
    offsets = {r - first for r in ranks}
    if len(offsets) != len(ranks):
        return None
    covered, axes = {0}, []
    while len(covered) < len(offsets):
        stride = min(offsets - covered)
        size = 1
        while all(c + size * stride in offsets for c in covered):
            size += 1
        axes.append((stride, size))
        covered = {c + i * stride for c in covered for i in range(size)}
        if not covered <= offsets:
            return None
    if covered != offsets or any((first // s) % n for s, n in axes):
        return None
    return tuple(axes)


def leader_of(ranks: Sequence[int], dst: int | None) -> int | None:
    """The rank of ``ranks`` at ``dst``'s coordinates along their axes (None for None).

    Raises:
        ValueError: ``dst`` is outside the group and the group is not made of axes of a
            row-major grid, so its coordinates cannot be known.
    """
    if dst is None:
        return None
    if dst in ranks:
        return dst
    if len(ranks) == 1:
        return ranks[0]
    axes = grid_axes(ranks)
    if axes is None:
        raise ValueError(
            f"cannot place rank {dst} along the axis of ranks {list(ranks)}: the placements' "
            "groups must be axes of one row-major grid (ProcessGroupMesh or DeviceMesh)"
        )
    return min(ranks) + sum(((dst // s) % n) * s for s, n in axes)


def gather_level(
    values: torch.Tensor,
    part: Block | Blocks | FlatRange,
    shape: Sequence[int],
    group: dist.ProcessGroup | None,
    dst: int | None,
) -> torch.Tensor | None:
    """The tensor of ``shape`` whose ``part`` each rank of ``group`` holds, on ``dst``.

    One small object all-gather tells every rank the others' parts; then only the parts move:
    point to point to ``dst``, or one broadcast per holder when ``dst`` is None. The parts
    must cover the tensor; overlapping parts must agree (the last rank wins).

    Raises:
        ValueError: ``dst`` is not in the group, or the parts leave elements uncovered.
    """
    mine = part.real(values).reshape(-1).contiguous()
    if not dist.is_initialized():
        if dst not in (None, 0):
            raise ValueError(f"dst={dst} is not a rank: torch.distributed is not initialized")
        return assemble([(part, mine)], shape, values)
    ranks = list(group_ranks(group))
    if dst is not None and dst not in ranks:
        raise ValueError(f"dst={dst} is not a rank of the tensor's group {ranks}")
    parts: list[Block | Blocks | FlatRange] = all_gather_object(part, group)
    rank = dist.get_rank()
    pieces: list[tuple[Block | Blocks | FlatRange, torch.Tensor]] = []
    for holder, theirs in zip(ranks, parts, strict=True):
        if theirs.numel == 0:
            continue
        if dst is None:
            buf = mine.clone() if holder == rank else mine.new_empty(theirs.numel)
            broadcast(buf, src=holder, group=group)
            pieces.append((theirs, buf))
        elif holder == rank and rank == dst:
            pieces.append((theirs, mine))
        elif holder == rank:
            send(mine, dst=dst, group=group)
        elif rank == dst:
            buf = mine.new_empty(theirs.numel)
            recv(buf, src=holder, group=group)
            pieces.append((theirs, buf))
    if dst is not None and rank != dst:
        return None
    return assemble(pieces, shape, values)


def assemble(
    pieces: Sequence[tuple[Block | Blocks | FlatRange, torch.Tensor]],
    shape: Sequence[int],
    like: torch.Tensor,
) -> torch.Tensor:
    """A tensor of ``shape`` filled from ``(part, values)`` pieces that must cover it.

    Raises:
        ValueError: The pieces leave elements uncovered.
    """
    full = like.new_empty(tuple(shape))
    covered = torch.zeros(tuple(shape), dtype=torch.bool)
    for part, values in pieces:
        part.put(full, values.to(full.device))
        part.put(covered, torch.ones(part.numel, dtype=torch.bool))
    if not bool(covered.all()):
        missing = int((~covered).sum())
        raise ValueError(
            f"the parts of the group leave {missing} of {covered.numel()} elements of a "
            f"tensor of shape {tuple(shape)} uncovered; every element must be held by some rank"
        )
    return full


def gather_placed(
    values: torch.Tensor | None,
    placements: Sequence[Placement],
    shape: Sequence[int],
    dtype: torch.dtype,
    dst: int | None,
    inner: InnerGather | None = None,
) -> torch.Tensor | None:
    """The whole tensor on global rank ``dst`` (every rank when None), None elsewhere.

    Collective over the groups of ``placements``: every rank holding a part of the tensor
    calls it, and, for an :class:`Owned` axis, the other ranks of that axis too (with
    ``values=None`` and only the owned placement and those outside it).

    Args:
        values: What this rank holds (the innermost level's local tensor), None if nothing.
        placements: The tensor's placements, outermost first.
        shape: The whole tensor's shape.
        dtype: Its dtype (for buffers of ranks that hold nothing yet).
        dst: The global rank that receives the tensor, or None for every rank.
        inner: Gathers the innermost splitting level itself (a chunk gatherer, a ZeRO
            bucket gather) instead of the generic per-part exchange.

    Raises:
        ValueError: ``dst`` ends without the tensor (the placements do not reach it).
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    if dst is not None and not 0 <= dst < world:
        raise ValueError(f"dst={dst} is not a rank of the job (world size {world}); pass a rank")
    shapes = level_shapes(placements, shape)
    me = this_rank()
    held, active = values, values is not None
    innermost = max((i for i, p in enumerate(placements) if p.splits), default=-1)
    for i in reversed(range(len(placements))):
        placement = placements[i]
        ranks = axis_ranks(placement.group)
        if isinstance(placement.part, Replicate):
            leader = _replica_leader(ranks, dst)
            active = active and (leader is None or me == leader)
            continue
        if isinstance(placement.part, Owned):
            held, active = _owned(held, active, placement, ranks, shapes[i], dtype, dst)
            continue
        leader = leader_of(ranks, dst)
        if active:
            if i == innermost and inner is not None:
                held = inner(leader)
            else:
                assert held is not None
                held = gather_level(held, placement.part, shapes[i], placement.group, leader)
            active = leader is None or me == leader
    if dst is not None and me != dst:
        return None
    if not active or held is None:
        raise ValueError(
            f"rank {me} did not receive the tensor of shape {tuple(shape)}: its placements "
            f"{list(placements)} do not lead to it; describe every axis the tensor is split, "
            "replicated or owned along"
        )
    return held


def _comm_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a buffer received over ``group`` lives: the current GPU under NCCL, else CPU."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _replica_leader(ranks: Sequence[int], dst: int | None) -> int | None:
    """The replica that goes on: ``dst``'s coordinate, or the first when it has none here.

    A replicated axis moves nothing, so a group that is no grid axis (the stages sharing a
    tied weight) may pick its first rank.
    """
    try:
        return leader_of(ranks, dst)
    except ValueError:
        return ranks[0]


def _owned(
    held: torch.Tensor | None,
    active: bool,
    placement: Placement,
    ranks: Sequence[int],
    shape: Sequence[int],
    dtype: torch.dtype,
    dst: int | None,
) -> tuple[torch.Tensor | None, bool]:
    """An owned axis: the owner gives the block to ``dst`` (or broadcasts it)."""
    assert isinstance(placement.part, Owned)
    if placement.part.owner >= len(ranks):
        raise ValueError(
            f"{placement} names coordinate {placement.part.owner} of an axis of {len(ranks)} ranks"
        )
    owner, me = ranks[placement.part.owner], this_rank()
    if len(ranks) == 1:
        return held, active
    if dst is None:
        buf = held if me == owner and held is not None else \
            torch.empty(tuple(shape), dtype=dtype, device=_comm_device(placement.group))
        broadcast(buf.contiguous() if me == owner else buf, src=owner, group=placement.group)
        return buf, True
    if dst not in ranks:
        return None, False
    if me == owner and me != dst:
        assert held is not None and active, "the owner must hold the block before sending it"
        send(held.contiguous(), dst=dst, group=placement.group)
        return None, False
    if me == dst and me != owner:
        buf = torch.empty(tuple(shape), dtype=dtype, device=_comm_device(placement.group))
        recv(buf, src=owner, group=placement.group)
        return buf, True
    return held, active
