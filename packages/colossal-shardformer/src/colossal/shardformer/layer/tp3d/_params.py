"""Parameters of the 3D layers: this rank's part of a whole tensor, marked with its placements.

Each parameter is a part of the whole tensor in torch's layout, described by one
:class:`~colossal.core.Placement` per cube axis, outermost first: a :class:`Block` of the
block the level above holds where the axis splits it, :class:`Replicate` where every rank of
the axis holds the same copy. A layer states the levels as ``(role, dim)`` pairs
(``dim=None``: replicated along that role's axis); the gradient norm, checkpoint IO and
:func:`~colossal.shardformer.layer.enable_full_state_dict` read the marks.

Fresh layers are initialized like the native module they replace, from a seed every rank of
the tensor-parallel group agrees on: each rank builds the same whole tensor and keeps its part.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from torch import nn

from colossal.core import Block, Placement, Replicate, mark_sharded, shard_spec
from colossal.core.comm import broadcast_object
from colossal.shardformer.layer._utils import group_size, src_rank
from colossal.shardformer.layer.tp3d._cube import Cube3D

__all__ = [
    "Level",
    "agreed_seed",
    "placements_for",
    "seeded",
    "shard_whole",
    "tied_weight",
]

Level = tuple[str, int | None]
"""``(role, dim)``: split ``dim`` among the ranks of the role's axis, or replicate (None)."""

_M = TypeVar("_M", bound=nn.Module)


def agreed_seed(cube: Cube3D) -> int:
    """A seed drawn from the global RNG and broadcast over the tensor-parallel group."""
    seed = int(torch.randint(0, 2**62, ()).item())
    group = cube.dims.group("tp")
    if group_size(group) > 1:
        seed = int(broadcast_object(seed, src=src_rank(group), group=group))
    return seed


def seeded(factory: Callable[[], _M], seed: int) -> _M:
    """``factory()`` run with the CPU RNG seeded by ``seed`` (the global RNG left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return factory()


def placements_for(shape: Sequence[int], cube: Cube3D, levels: Sequence[Level]) -> list[Placement]:
    """This rank's placements of a tensor of ``shape`` split and replicated as ``levels``."""
    q = cube.depth
    above = tuple(shape)
    placements = []
    for role, dim in levels:
        axis, group = cube.axis(role), cube.group(role)
        if dim is None:
            placements.append(Placement(axis, Replicate(), group))
            continue
        step = above[dim] // q
        start = cube.coordinate(role) * step
        block = Block.along(above, dim, start, start + step)
        placements.append(Placement(axis, block, group))
        above = tuple(block.sizes)
    return placements


def shard_whole(whole: torch.Tensor, cube: Cube3D, levels: Sequence[Level]) -> nn.Parameter:
    """A parameter holding this rank's part of ``whole``, marked with its placements.

    Args:
        whole: The whole tensor in torch's layout (its ``requires_grad`` is kept).
        cube: The cube and the layer's orientation.
        levels: One ``(role, dim)`` per axis, outermost first (each role once).
    """
    placements = placements_for(whole.shape, cube, levels)
    value = whole.detach()
    for placement in placements:
        if isinstance(placement.part, Block):
            value = placement.part.take(value)
    param = nn.Parameter(value.clone().contiguous(), requires_grad=whole.requires_grad)
    mark_sharded(param, placements, whole.shape)
    return param


def tied_weight(
    module: str, weight: torch.Tensor, shape: Sequence[int], cube: Cube3D, levels: Sequence[Level]
) -> nn.Parameter:
    """``weight`` (another layer's parameter) checked to be laid out as ``levels`` demand.

    Raises:
        TypeError: ``weight`` is not a parameter.
        ValueError: Its whole shape or its placements differ from what this layer needs
            (e.g. an embedding of the other orientation).
    """
    if not isinstance(weight, nn.Parameter):
        raise TypeError(f"{module}: a tied weight must be an nn.Parameter, got {type(weight)}")
    spec = shard_spec(weight)
    wanted = [(p.axis, p.part) for p in placements_for(shape, cube, levels)]
    held = [] if spec is None else [(p.axis, p.part) for p in spec.placements]
    if spec is None or tuple(spec.shape) != tuple(shape) or held != wanted:
        whole = "an unmarked tensor" if spec is None else f"a part of {tuple(spec.shape)}"
        raise ValueError(
            f"{module}: the tied weight must be this rank's part of a {tuple(shape)} tensor "
            f"placed {wanted}; got {whole} placed {held}; tie layers of the same orientation "
            "(swapped flag) and sizes"
        )
    return weight
