"""One placement per parallel axis, and the part of the whole tensor they compose to.

A sharded tensor is described by a sequence of :class:`Placement`, outermost first. Each
says, for one parallel axis (``"tp"``, ``"ep"``, ``"dp"``, ``"pp"``, a 2D/3D grid axis, ...),
which part of *the block the level above holds* this rank holds (the whole tensor for the
first level) and over which process group the other parts of that block lie:

* a :class:`~colossal.core.sharded.parts.Block` / ``Blocks``: a box of the block above
  (tensor parallel, FSDP2's ``Shard(0)``, an expert's slice);
* a :class:`~colossal.core.sharded.parts.FlatRange`: a flat range of the block above (ZeRO's
  and Gemini's shards);
* :class:`Replicate`: all of the block above, the same on every rank of the axis;
* :class:`Owned`: all of the block above, held by one rank of the axis only (a pipeline
  stage's parameters along ``pp``); the other ranks of the axis hold none of it.

So "a ZeRO flat range of a tensor-parallel block" is ``(Placement("tp", Block(...), tp),
Placement("dp", FlatRange(...), dp))`` and "a Gemini chunk piece of a tensor-parallel block,
replicated over extra data parallelism" adds ``Placement("dp_replicate", Replicate(), g)``:
no combination needs its own adapter. :func:`compose` folds the levels into one part of the
whole tensor (a :class:`Nested` part when they do not collapse to a block or a flat range),
which loaders read and in-place writers write.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from colossal.core.sharded.parts import Block, Blocks, FlatRange, SliceReader, check_shape

__all__ = [
    "LocalPart",
    "Nested",
    "Owned",
    "Placement",
    "Replicate",
    "compose",
    "level_shapes",
]


@dataclass(frozen=True)
class Replicate:
    """The whole block above, held alike by every rank of the axis."""


@dataclass(frozen=True)
class Owned:
    """The whole block above, held by the axis rank at coordinate ``owner`` only.

    Attributes:
        owner: Coordinate (index in the axis group) of the rank holding it.
    """

    owner: int

    def __post_init__(self) -> None:
        if not isinstance(self.owner, int) or self.owner < 0:
            raise ValueError(f"Owned(owner={self.owner!r}) needs a coordinate >= 0")


AxisPart = Block | Blocks | FlatRange | Replicate | Owned
"""What a rank holds of the block above along one axis."""


@dataclass(frozen=True, eq=False)
class Placement:
    """How a tensor is placed along one parallel axis.

    Attributes:
        axis: The axis' name (``"tp"``, ``"dp"``, ``"ep"``, ``"pp"``, ``"tp_row"``, ...).
        part: What this rank holds of the block the level above holds.
        group: The axis' ranks (the other parts lie there); None: the whole job.
        local_shape: Shape of the tensor this level holds when it is larger than ``part``
            (padding after the real elements, :meth:`Block.real`); None: the part's own.

    Raises:
        TypeError: ``part`` is not one of the axis parts.
    """

    axis: str
    part: AxisPart
    group: dist.ProcessGroup | None = None
    local_shape: tuple[int, ...] | None = field(default=None)

    def __post_init__(self) -> None:
        if not isinstance(self.part, Block | Blocks | FlatRange | Replicate | Owned):
            raise TypeError(
                f"Placement part must be a Block, Blocks, FlatRange, Replicate or Owned, got "
                f"{type(self.part).__name__}"
            )
        if self.local_shape is not None:
            object.__setattr__(self, "local_shape", check_shape(self.local_shape))

    @property
    def splits(self) -> bool:
        """Whether the ranks of the axis hold different elements (a block or a range)."""
        return isinstance(self.part, Block | Blocks | FlatRange)

    def held_shape(self, above: Sequence[int]) -> tuple[int, ...]:
        """Shape of what this level holds, given the shape of the block above."""
        if self.local_shape is not None:
            return self.local_shape
        if isinstance(self.part, Replicate | Owned):
            return tuple(above)
        if isinstance(self.part, FlatRange):
            return (self.part.numel,)
        return tuple(self.part.sizes)

    def real_shape(self, above: Sequence[int]) -> tuple[int, ...]:
        """Shape of the real elements this level holds (without padding)."""
        if isinstance(self.part, Replicate | Owned):
            return tuple(above)
        if isinstance(self.part, FlatRange):
            return (self.part.numel,)
        return tuple(self.part.sizes)

    def key(self) -> tuple[str, AxisPart, int, tuple[int, ...] | None]:
        """A hashable description (axis, part, group identity, local shape)."""
        return (self.axis, self.part, id(self.group), self.local_shape)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Placement) and self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())

    def __repr__(self) -> str:
        pad = f", local_shape={self.local_shape}" if self.local_shape is not None else ""
        return f"Placement({self.axis!r}, {self.part}{pad})"


def level_shapes(placements: Sequence[Placement], shape: Sequence[int]) -> list[tuple[int, ...]]:
    """Shapes of the whole tensor and of what each level holds (padding included)."""
    shapes = [check_shape(shape)]
    for placement in placements:
        shapes.append(placement.held_shape(shapes[-1]))
    return shapes


def _merge_blocks(outer: Block, inner: Block) -> Block:
    return Block(
        tuple(o + i for o, i in zip(outer.offsets, inner.offsets, strict=True)), inner.sizes
    )


@dataclass(frozen=True)
class Nested:
    """A part of a part: each level is a part of what the level before it holds.

    ``shapes[i]`` is the shape of the tensor level ``i`` is a part of (``shapes[0]`` the whole
    tensor's); a level holding padding makes the next shape larger than its part.

    Attributes:
        levels: The parts, outermost first (no :class:`Replicate` / :class:`Owned`).
        shapes: The shape each level is a part of.
    """

    levels: tuple[Block | Blocks | FlatRange, ...]
    shapes: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if len(self.levels) != len(self.shapes) or not self.levels:
            raise ValueError(f"Nested needs one shape per level, got {self}")

    @property
    def numel(self) -> int:
        """Elements held (the innermost part's)."""
        return self.levels[-1].numel

    @property
    def sizes(self) -> tuple[int, ...]:
        """Shape of the innermost part."""
        return _real_sizes(self.levels[-1])

    def check(self, shape: Sequence[int]) -> None:
        """Raise ValueError unless the outermost level fits ``shape`` and each the next."""
        if tuple(check_shape(shape)) != self.shapes[0]:
            raise ValueError(f"{self} describes a tensor of shape {self.shapes[0]}, not {shape}")
        for level, above in zip(self.levels, self.shapes, strict=True):
            level.check(above)

    def is_whole(self, shape: Sequence[int]) -> bool:
        """Whether every level is all of the level above (and nothing is padded)."""
        return all(
            level.is_whole(above) for level, above in zip(self.levels, self.shapes, strict=True)
        ) and tuple(shape) == self.shapes[0]

    def real(self, local: torch.Tensor) -> torch.Tensor:
        """The real elements of ``local`` (the innermost part's values, padding dropped)."""
        values = self.levels[-1].real(local)
        if self.padded:
            values = values.reshape(-1)[_real_mask(self)]
        return values

    @property
    def padded(self) -> bool:
        """Whether an outer level holds padding (its shape is larger than its part)."""
        return any(
            _real_sizes(level) != self.shapes[i + 1]
            for i, level in enumerate(self.levels[:-1])
        )

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This part of the whole tensor ``full`` (padded where a level holds padding)."""
        value = full
        for i, level in enumerate(self.levels):
            value = _pad_to(level.take(value), self.shapes[i + 1] if i + 1 < len(self.shapes)
                            else None)
        return value

    def put(self, full: torch.Tensor, values: torch.Tensor) -> None:
        """Copy ``values`` (this part's elements) into the whole tensor ``full``."""
        _put(self.levels, self.shapes, full, values)

    def read(self, read: SliceReader, shape: Sequence[int]) -> torch.Tensor:
        """Read the outermost level from the store, then cut the inner levels from it."""
        self.check(shape)
        value = self.levels[0].read(read, shape)
        for i, level in enumerate(self.levels[1:], start=1):
            value = level.take(_pad_to(value, self.shapes[i]))
        return value


def _pad_to(value: torch.Tensor, shape: tuple[int, ...] | None) -> torch.Tensor:
    """``value`` zero-padded at the end of each dim to ``shape`` (itself when it fits)."""
    if shape is None or tuple(value.shape) == shape:
        return value
    if value.dim() != len(shape):
        return value.reshape(shape)
    out = value.new_zeros(shape)
    out[tuple(slice(0, s) for s in value.shape)] = value
    return out


def _real_sizes(level: Block | Blocks | FlatRange) -> tuple[int, ...]:
    return (level.numel,) if isinstance(level, FlatRange) else tuple(level.sizes)


def _unpad(value: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
    """The leading ``sizes`` of ``value`` (the real elements before its padding)."""
    if tuple(value.shape) == sizes:
        return value
    if value.dim() != len(sizes):
        return value.reshape(-1)[: math.prod(sizes)]
    return value[tuple(slice(0, s) for s in sizes)]


def _put(levels: Sequence[Any], shapes: Sequence[tuple[int, ...]], full: torch.Tensor,
         values: torch.Tensor) -> None:
    if len(levels) == 1:
        levels[0].put(full, values)
        return
    below = _pad_to(levels[0].take(full).clone(), shapes[1])
    _put(levels[1:], shapes[1:], below, values)
    levels[0].put(full, _unpad(below, _real_sizes(levels[0])))


_MASKS: dict[Nested, torch.Tensor] = {}


def _real_mask(part: Nested) -> torch.Tensor:
    mask = _MASKS.get(part)
    if mask is None:
        flags = torch.ones(part.shapes[0], dtype=torch.bool)
        for i, level in enumerate(part.levels):
            taken = level.take(flags)
            if i + 1 < len(part.shapes):
                taken = _pad_to(taken, part.shapes[i + 1])  # padding: False
            flags = taken
        mask = _MASKS[part] = flags.reshape(-1)
    return mask


LocalPart = Block | Blocks | FlatRange | Nested
"""Which elements of the whole tensor a rank holds."""


def compose(placements: Sequence[Placement], shape: Sequence[int]) -> LocalPart:
    """The part of a tensor of ``shape`` that ``placements`` give this rank.

    Replicated and owned levels hold all of the block above; consecutive blocks merge into
    one; a flat range of a whole, unpadded block is a flat range of the tensor. Anything else
    is a :class:`Nested` part.
    """
    shapes = level_shapes(placements, shape)
    levels: list[Block | Blocks | FlatRange] = []
    level_of: list[tuple[int, ...]] = []
    for i, placement in enumerate(placements):
        if not placement.splits:
            continue
        part = placement.part
        assert isinstance(part, Block | Blocks | FlatRange)
        above = shapes[i]
        if levels and isinstance(part, Block) and isinstance(levels[-1], Block) and (
            tuple(levels[-1].sizes) == above
        ):
            levels[-1] = _merge_blocks(levels[-1], part)
            continue
        if len(levels) == 1 and isinstance(part, FlatRange) and isinstance(levels[0], Block) and (
            levels[0].is_whole(shapes[0]) and above == shapes[0]
        ):
            levels[-1] = part
            continue
        levels.append(part)
        level_of.append(above)
    if not levels:
        return Block.whole(shapes[0])
    if len(levels) == 1:
        return levels[0]
    return Nested(tuple(levels), tuple(level_of))
