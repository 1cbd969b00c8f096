"""The parts of a tensor a rank can hold: a box, a flat range, several boxes.

Each part is described relative to a tensor of a given shape (the whole tensor, or the block
the level above holds, see :mod:`colossal.core.sharded.placement`) and can check that it fits,
take itself out of that tensor, put values back into it and read itself from a stored tensor
through a :data:`SliceReader` (``safe_open(...).get_slice``), reading no more than it needs.

* :class:`Block`: ``offsets[d] : offsets[d] + sizes[d]`` along every dim (a tensor-parallel
  shard, FSDP2's ``Shard(0)``, the whole tensor). A local tensor may be larger than the block
  along any dim (padding after the real elements, e.g. a vocabulary padded to a multiple of
  the tensor-parallel size): :meth:`Block.real` strips it.
* :class:`FlatRange`: elements ``[start, stop)`` of the row-major flattened tensor (ZeRO's
  and Gemini's flat shards); a 1-D local tensor, maybe with padding at its end.
* :class:`Blocks`: several blocks concatenated along one dim (a fused q/k/v projection split
  in tensor parallel keeps its slice of each segment).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["Block", "Blocks", "FlatRange", "SliceReader", "check_shape"]

SliceReader = Callable[[tuple[slice, ...] | None], torch.Tensor]
"""``read(index)``: the stored tensor's ``[index]`` (the whole tensor for ``None``)."""


def check_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """``shape`` as a tuple of ints, or ValueError when a size is negative."""
    out = tuple(int(s) for s in shape)
    if any(s < 0 for s in out):
        raise ValueError(f"shape {out} has a negative size")
    return out


@dataclass(frozen=True)
class Block:
    """A box of the global tensor: ``offsets[d] : offsets[d] + sizes[d]`` along every dim.

    Attributes:
        offsets: First index along each dim.
        sizes: Number of indices along each dim.

    Raises:
        ValueError: ``offsets`` and ``sizes`` differ in length or hold negative values.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        offsets, sizes = tuple(self.offsets), tuple(self.sizes)
        if len(offsets) != len(sizes):
            raise ValueError(
                f"Block offsets {offsets} and sizes {sizes} must have one entry per dim"
            )
        if any(not isinstance(v, int) or v < 0 for v in (*offsets, *sizes)):
            raise ValueError(f"Block offsets {offsets} and sizes {sizes} must be ints >= 0")
        object.__setattr__(self, "offsets", offsets)
        object.__setattr__(self, "sizes", sizes)

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Block:
        """The block of every element of a tensor of ``shape``."""
        shape = check_shape(shape)
        return cls((0,) * len(shape), shape)

    @classmethod
    def along(cls, shape: Sequence[int], dim: int, start: int, stop: int) -> Block:
        """Indices ``[start, stop)`` along ``dim`` and everything along the other dims."""
        shape = check_shape(shape)
        if not -len(shape) <= dim < len(shape):
            raise ValueError(f"dim={dim} is out of range for shape {shape}")
        dim %= len(shape)
        offsets = tuple(start if d == dim else 0 for d in range(len(shape)))
        sizes = tuple(stop - start if d == dim else s for d, s in enumerate(shape))
        return cls(offsets, sizes)

    @property
    def numel(self) -> int:
        """Elements in the block."""
        return math.prod(self.sizes)

    def index(self) -> tuple[slice, ...]:
        """The block as an index into the global tensor."""
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes, strict=True))

    def check(self, shape: Sequence[int]) -> None:
        """Raise ValueError unless the block lies inside a tensor of ``shape``."""
        shape = check_shape(shape)
        if len(shape) != len(self.sizes) or any(
            o + s > n for o, s, n in zip(self.offsets, self.sizes, shape, strict=True)
        ):
            raise ValueError(
                f"{self} does not fit a tensor of shape {shape}; describe a part of that tensor"
            )

    def is_whole(self, shape: Sequence[int]) -> bool:
        """Whether the block is the whole of a tensor of ``shape``."""
        return self == Block.whole(shape)

    def real(self, local: torch.Tensor) -> torch.Tensor:
        """The leading ``sizes`` of ``local`` (a view without the padding).

        Raises:
            ValueError: ``local`` is smaller than the block or has another number of dims.
        """
        if local.dim() != len(self.sizes) or any(
            n < s for n, s in zip(local.shape, self.sizes, strict=True)
        ):
            raise ValueError(
                f"local tensor of shape {tuple(local.shape)} cannot hold {self}; pass the "
                "tensor this rank holds"
            )
        return local[tuple(slice(0, s) for s in self.sizes)]

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This part of the global tensor ``full`` (a view)."""
        self.check(full.shape)
        return full[self.index()]

    def put(self, full: torch.Tensor, values: torch.Tensor) -> None:
        """Copy ``values`` (the block's elements) into the global tensor ``full``."""
        self.take(full).copy_(values.reshape(self.sizes))

    def read(self, read: SliceReader, shape: Sequence[int]) -> torch.Tensor:
        """Read only the block from a stored tensor of ``shape`` (shape ``sizes``)."""
        self.check(shape)
        if self.is_whole(shape):
            return read(None)
        return read(self.index())


@dataclass(frozen=True)
class FlatRange:
    """Elements ``[start, stop)`` of the row-major flattened global tensor.

    Attributes:
        start: First element.
        stop: One past the last element.

    Raises:
        ValueError: ``start`` is negative or larger than ``stop``.
    """

    start: int
    stop: int

    def __post_init__(self) -> None:
        if not isinstance(self.start, int) or not isinstance(self.stop, int):
            raise ValueError(f"FlatRange bounds must be ints, got {self.start!r}, {self.stop!r}")
        if not 0 <= self.start <= self.stop:
            raise ValueError(
                f"FlatRange({self.start}, {self.stop}) needs 0 <= start <= stop"
            )

    @property
    def numel(self) -> int:
        """Elements in the range."""
        return self.stop - self.start

    def check(self, shape: Sequence[int]) -> None:
        """Raise ValueError unless the range lies inside a tensor of ``shape``."""
        total = math.prod(check_shape(shape))
        if self.stop > total:
            raise ValueError(
                f"{self} does not fit a tensor of shape {tuple(shape)} ({total} elements); "
                "describe a part of that tensor"
            )

    def is_whole(self, shape: Sequence[int]) -> bool:
        """Whether the range is every element of a tensor of ``shape``."""
        return self.start == 0 and self.stop == math.prod(check_shape(shape))

    def real(self, local: torch.Tensor) -> torch.Tensor:
        """The first ``numel`` elements of ``local``, flattened (without the padding).

        Raises:
            ValueError: ``local`` has fewer elements than the range.
        """
        if local.numel() < self.numel:
            raise ValueError(
                f"local tensor of {local.numel()} elements cannot hold {self}; pass the "
                "tensor this rank holds"
            )
        return local.reshape(-1)[: self.numel]

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This part of the global tensor ``full`` (1-D)."""
        self.check(full.shape)
        return full.reshape(-1)[self.start : self.stop]

    def put(self, full: torch.Tensor, values: torch.Tensor) -> None:
        """Copy ``values`` (the range's elements) into the global (contiguous) ``full``."""
        self.check(full.shape)
        full.view(-1)[self.start : self.stop].copy_(values.reshape(-1))

    def read(self, read: SliceReader, shape: Sequence[int]) -> torch.Tensor:
        """Read only the rows (dim 0) covering the range and trim them to it (1-D)."""
        shape = check_shape(shape)
        self.check(shape)
        if not shape or self.is_whole(shape):
            return read(None).reshape(-1)[self.start : self.stop]
        row = math.prod(shape[1:])
        if row == 0 or self.numel == 0:
            return read((slice(0, 0),)).reshape(-1)
        first, last = self.start // row, -(-self.stop // row)
        rows = read((slice(first, last),)).reshape(-1)
        skip = self.start - first * row
        return rows[skip : skip + self.numel]


@dataclass(frozen=True)
class Blocks:
    """Several boxes of the global tensor, held one after another along ``dim``.

    A fused projection split in tensor parallel (GPT-2's ``c_attn`` holds q, k and v side by
    side; each rank keeps its slice of each) holds one :class:`Block` of each segment; its
    local tensor is their concatenation along ``dim``. Every block spans the whole tensor
    along the other dims. No padding: ``local()`` is exactly the blocks.

    Attributes:
        dim: The dim the blocks are concatenated along.
        blocks: The boxes, in the order they are held.

    Raises:
        ValueError: ``blocks`` is empty or the blocks differ in rank.
    """

    dim: int
    blocks: tuple[Block, ...]

    def __post_init__(self) -> None:
        blocks = tuple(self.blocks)
        if not blocks or not all(isinstance(b, Block) for b in blocks):
            raise ValueError(f"Blocks needs one or more Block, got {blocks!r}")
        ndim = len(blocks[0].sizes)
        if any(len(b.sizes) != ndim for b in blocks) or not 0 <= self.dim < ndim:
            raise ValueError(f"Blocks(dim={self.dim}) needs blocks of one rank > dim: {blocks}")
        object.__setattr__(self, "blocks", blocks)

    @property
    def numel(self) -> int:
        """Elements in all the blocks."""
        return sum(b.numel for b in self.blocks)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Shape of the local tensor (the blocks concatenated along ``dim``)."""
        first = self.blocks[0].sizes
        total = sum(b.sizes[self.dim] for b in self.blocks)
        return tuple(total if d == self.dim else s for d, s in enumerate(first))

    def check(self, shape: Sequence[int]) -> None:
        """Raise ValueError unless every block lies inside a tensor of ``shape``."""
        for block in self.blocks:
            block.check(shape)

    def is_whole(self, shape: Sequence[int]) -> bool:
        """Whether the blocks are the whole tensor, in order (one block of everything)."""
        return len(self.blocks) == 1 and self.blocks[0].is_whole(shape)

    def real(self, local: torch.Tensor) -> torch.Tensor:
        """``local`` itself (it carries no padding).

        Raises:
            ValueError: ``local`` is not shaped like the concatenated blocks.
        """
        if tuple(local.shape) != self.sizes:
            raise ValueError(
                f"local tensor of shape {tuple(local.shape)} cannot hold {self}; pass the "
                "tensor this rank holds"
            )
        return local

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This part of the global tensor ``full`` (a new tensor)."""
        return torch.cat([b.take(full) for b in self.blocks], dim=self.dim)

    def put(self, full: torch.Tensor, values: torch.Tensor) -> None:
        """Copy ``values`` (the concatenated blocks) into the global tensor ``full``."""
        values = values.reshape(self.sizes)
        pieces = values.split([b.sizes[self.dim] for b in self.blocks], dim=self.dim)
        for block, piece in zip(self.blocks, pieces, strict=True):
            block.put(full, piece)

    def read(self, read: SliceReader, shape: Sequence[int]) -> torch.Tensor:
        """Read only the blocks from a stored tensor of ``shape``, concatenated along ``dim``."""
        return torch.cat([b.read(read, shape) for b in self.blocks], dim=self.dim)
