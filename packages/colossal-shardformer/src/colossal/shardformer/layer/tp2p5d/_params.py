"""Parameters of the 2.5D layers: this rank's part of a whole tensor, marked with its placements.

A layer states a parameter's layout as one *level* per grid axis, ``(axis, dim)`` in the
grid's order (``"dep"``, ``"col"``, ``"row"``): split ``dim`` of the block the level above
holds into as many blocks as the axis has ranks and keep this rank's, or (``dim=None``) hold
the same copy as every rank of the axis. Each level becomes a
:class:`~colossal.core.Placement` (``Block`` or ``Replicate``) over the axis' group, so the
gradient norm, checkpoint IO and :func:`~colossal.shardformer.layer.enable_full_state_dict`
read the parameter as the part it is. Every 2.5D parameter is replicated along the depth.

A fresh layer builds the native module from a seed every tensor-parallel rank agrees on, and
each rank keeps its part of the same whole tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from torch import nn

from colossal.core import Block, Placement, Replicate, mark_sharded, shard_spec
from colossal.core.comm import broadcast_object
from colossal.shardformer.layer._utils import group_size, src_rank
from colossal.shardformer.layer.tp2p5d._grid import Grid2p5D

__all__ = ["Level", "agreed_seed", "placements_for", "seeded", "shard_whole", "tied_weight"]

Level = tuple[str, int | None]
"""``(axis, dim)``: keep this rank's block of ``dim`` along ``axis`` (None: a copy)."""

_M = TypeVar("_M", bound=nn.Module)


def agreed_seed(grid: Grid2p5D) -> int:
    """A seed drawn from the global RNG of the tensor-parallel group's first rank, shared."""
    seed = int(torch.randint(0, 2**62, ()).item())
    group = grid.dims.group("tp")
    if group_size(group) > 1:
        seed = int(broadcast_object(seed, src=src_rank(group), group=group))
    return seed


def seeded(factory: Callable[[], _M], seed: int) -> _M:
    """``factory()`` under a CPU RNG seeded with ``seed``; the global RNG is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return factory()


def placements_for(
    shape: Sequence[int], grid: Grid2p5D, levels: Sequence[Level]
) -> list[Placement]:
    """This rank's placements of a tensor of ``shape`` laid out as ``levels``."""
    above = tuple(int(s) for s in shape)
    out = []
    for name, dim in levels:
        axis, group = grid.axis(name), grid.group(name)
        if dim is None:
            out.append(Placement(axis, Replicate(), group))
            continue
        step = above[dim] // grid.parts(name)
        start = grid.index(name) * step
        block = Block.along(above, dim, start, start + step)
        out.append(Placement(axis, block, group))
        above = tuple(block.sizes)
    return out


def shard_whole(whole: torch.Tensor, grid: Grid2p5D, levels: Sequence[Level]) -> nn.Parameter:
    """A parameter holding this rank's part of ``whole``, marked with its placements.

    Args:
        whole: The whole tensor in torch's layout (its ``requires_grad`` is kept).
        grid: The 2.5D grid.
        levels: One ``(axis, dim)`` per grid axis, outermost level first.
    """
    placements = placements_for(whole.shape, grid, levels)
    value = whole.detach()
    for placement in placements:
        if isinstance(placement.part, Block):
            value = placement.part.take(value)
    param = nn.Parameter(value.clone().contiguous(), requires_grad=whole.requires_grad)
    mark_sharded(param, placements, whole.shape)
    return param


def tied_weight(
    module: str,
    weight: torch.Tensor,
    shape: Sequence[int],
    grid: Grid2p5D,
    levels: Sequence[Level],
) -> nn.Parameter:
    """``weight`` (another layer's parameter), checked to be laid out as ``levels`` say.

    Raises:
        TypeError: ``weight`` is not a parameter.
        ValueError: Its whole shape or placements differ from this layer's (e.g. a
            :class:`~.embedding.VocabParallelEmbedding2p5D` tied to a
            :class:`~.linear.Classifier2p5D`).
    """
    if not isinstance(weight, nn.Parameter):
        raise TypeError(f"{module}: a tied weight must be an nn.Parameter, got {type(weight)}")
    spec = shard_spec(weight)
    wanted = [(p.axis, p.part) for p in placements_for(shape, grid, levels)]
    held = [] if spec is None else [(p.axis, p.part) for p in spec.placements]
    if spec is None or tuple(spec.shape) != tuple(shape) or held != wanted:
        what = "an unmarked tensor" if spec is None else f"a part of {tuple(spec.shape)}"
        raise ValueError(
            f"{module}: the tied weight must be this rank's part of a {tuple(shape)} tensor "
            f"placed {wanted}; got {what} placed {held}; tie Embedding2p5D with "
            "Classifier2p5D and VocabParallelEmbedding2p5D with VocabParallelClassifier2p5D, "
            "of equal sizes"
        )
    return weight
