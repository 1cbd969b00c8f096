"""Sharded tensors held in memory: replicated, a local part, or nothing on this rank."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from colossal.core.sharded.gather import this_rank
from colossal.core.sharded.parts import Block, Blocks, FlatRange, check_shape
from colossal.core.sharded.placement import Owned, Placement, level_shapes
from colossal.core.sharded.protocol import Placed, ShardedTensor, placements_of

logger = logging.getLogger(__name__)

__all__ = ["Absent", "LocalShard", "Replicated", "TensorBacked", "as_placements"]


def as_placements(
    part: Block | Blocks | FlatRange | Placement | Sequence[Placement],
    group: dist.ProcessGroup | None = None,
    axis: str = "shard",
) -> tuple[Placement, ...]:
    """Placements from one part along ``axis`` over ``group``, or placements as given.

    Raises:
        TypeError: ``part`` is neither a part nor placements.
        ValueError: placements are given together with a ``group``.
    """
    if isinstance(part, Block | Blocks | FlatRange):
        return (Placement(axis, part, group),)
    if group is not None:
        raise ValueError("pass the group inside each Placement, not next to placements")
    if not isinstance(part, Placement | Sequence):
        raise TypeError(
            f"part must be a Block, Blocks, FlatRange or Placement(s), got {type(part).__name__}"
        )
    return placements_of(part)


def check_placements(
    placements: Sequence[Placement], shape: Sequence[int], values: torch.Tensor | None
) -> None:
    """Raise ValueError unless each level fits the one above and ``values`` hold the last."""
    shapes = level_shapes(placements, shape)
    for placement, above in zip(placements, shapes, strict=False):
        if placement.splits:
            placement.part.check(above)  # type: ignore[union-attr]
    splitting = [p for p in placements if p.splits]
    if values is not None and splitting:
        splitting[-1].part.real(values)  # type: ignore[union-attr]


class TensorBacked(Placed):
    """Base for a sharded tensor that wraps one tensor, kept as ``self.tensor``.

    ``shape`` and ``dtype`` are the wrapped tensor's (the whole tensor's, for a ``DTensor``);
    a subclass sets ``self.tensor`` and supplies ``placements`` and ``local``.
    """

    tensor: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        """The wrapped tensor's (global) shape."""
        return self.tensor.shape

    @property
    def dtype(self) -> torch.dtype:
        """The wrapped tensor's dtype."""
        return self.tensor.dtype


class Replicated(TensorBacked):
    """The trivial sharded tensor: every rank holds the whole tensor (no placements).

    Args:
        tensor: The tensor (the same on every rank).
    """

    placements: tuple[Placement, ...] = ()

    def __init__(self, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"Replicated needs a torch.Tensor, got {type(tensor).__name__}")
        self.tensor = tensor

    @property
    def part(self) -> Block:
        """Everything."""
        return Block.whole(self.tensor.shape)

    def local(self) -> torch.Tensor:
        """The tensor itself."""
        return self.tensor

    def gather(self, dst: int | None = None) -> torch.Tensor | None:
        """The tensor itself on ``dst`` (or everywhere when None); no communication."""
        return self.tensor if dst is None or dst == this_rank() else None

    def __repr__(self) -> str:
        return f"Replicated(shape={tuple(self.shape)}, dtype={self.dtype})"


class LocalShard(Placed):
    """A part of a tensor held in memory, placed along one or more parallel axes.

    Args:
        values: This rank's elements (shaped like the innermost part, or larger with padding).
        part: One part (then placed along ``axis`` over ``group``) or the placements.
        shape: Shape of the whole, unpadded tensor.
        group: The ranks of ``axis`` (the whole job when None), with a single part only.
        axis: The axis' name, with a single part only.

    Raises:
        TypeError: ``values`` is not a tensor or ``part`` neither a part nor placements.
        ValueError: a level does not fit the one above or ``values`` cannot hold the part.
    """

    def __init__(
        self,
        values: torch.Tensor,
        part: Block | Blocks | FlatRange | Placement | Sequence[Placement],
        shape: Sequence[int],
        group: dist.ProcessGroup | None = None,
        axis: str = "shard",
    ) -> None:
        if not isinstance(values, torch.Tensor):
            raise TypeError(
                f"LocalShard values must be a torch.Tensor, got {type(values).__name__}"
            )
        self._shape = torch.Size(check_shape(shape))
        self._placements = as_placements(part, group, axis)
        check_placements(self._placements, self._shape, values)
        self.values = values

    @property
    def shape(self) -> torch.Size:
        """Shape of the whole tensor."""
        return self._shape

    @property
    def dtype(self) -> torch.dtype:
        """The values' dtype."""
        return self.values.dtype

    @property
    def placements(self) -> tuple[Placement, ...]:
        """The placements, outermost first."""
        return self._placements

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The group of the innermost splitting axis (None: the whole job or none)."""
        splitting = [p for p in self._placements if p.splits]
        return splitting[-1].group if splitting else None

    def local(self) -> torch.Tensor:
        """This rank's values."""
        return self.values

    def __repr__(self) -> str:
        return f"LocalShard(shape={tuple(self._shape)}, placements={list(self._placements)})"


class Absent(Placed):
    """A tensor this rank holds none of, owned by another rank along some axis.

    A pipeline stage that does not hold a parameter joins its gather with ``Absent`` and
    the ``Owned`` placement naming the stage that does.

    Args:
        shape: The whole tensor's shape.
        dtype: Its dtype.
        placements: The axes it is owned along (each an :class:`Owned` placement).

    Raises:
        ValueError: a placement is not :class:`Owned`.
    """

    def __init__(
        self, shape: Sequence[int], dtype: torch.dtype, placements: Sequence[Placement]
    ) -> None:
        self._shape, self._dtype = torch.Size(check_shape(shape)), dtype
        self._placements = placements_of(placements)
        if not all(isinstance(p.part, Owned) for p in self._placements):
            raise ValueError(f"Absent takes Owned placements only, got {list(self._placements)}")

    @property
    def shape(self) -> torch.Size:
        """The whole tensor's shape."""
        return self._shape

    @property
    def dtype(self) -> torch.dtype:
        """Its dtype."""
        return self._dtype

    @property
    def placements(self) -> tuple[Placement, ...]:
        """The owned axes."""
        return self._placements

    @property
    def part(self) -> Block | FlatRange:
        """Nothing: an empty block (an empty range of a scalar)."""
        if not self._shape:
            return FlatRange(0, 0)
        return Block((0,) * len(self._shape), (0, *self._shape[1:]))

    def holds(self) -> bool:
        """Never."""
        return False

    def local(self) -> torch.Tensor:
        """An empty tensor."""
        return torch.empty(0, dtype=self._dtype)

    def __repr__(self) -> str:
        return f"Absent(shape={tuple(self._shape)}, placements={list(self._placements)})"


if TYPE_CHECKING:  # a type checker verifies that these implement the protocol

    def _implements(tensor: LocalShard | Replicated | Absent) -> ShardedTensor:
        return tensor
