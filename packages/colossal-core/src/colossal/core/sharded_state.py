"""Sharded state: one contract for "a tensor of which this rank holds a part".

Checkpoint IO (and, later, the gradient norm) speak only to :class:`ShardedTensor`, whatever
parallelism produced the shard. An implementation says what the whole tensor is (``shape``
and ``dtype``, unpadded), which part of it this rank holds (``part``), gives that part
(``local()``) and gathers the whole tensor to one named rank (``gather(dst)``).

Three kinds of part cover the layouts Colossal uses:

* :class:`Block`: a box of the global tensor, ``offsets[d] : offsets[d] + sizes[d]`` along
  every dim. A tensor-parallel shard is a block split along one dim (a column-parallel
  linear's weight holds rows ``[r * n / tp, (r + 1) * n / tp)``); FSDP2's ``Shard(0)``
  ``DTensor`` is a block of rows; a replicated tensor is the block of everything. When the
  global tensor is padded for even splitting (a vocabulary padded to a multiple of the
  tensor-parallel size), ``part`` describes only the real elements and ``local()`` may be
  larger: its leading ``sizes`` along each dim are the part, the rest is padding.
* :class:`FlatRange`: elements ``[start, stop)`` of the row-major flattened global tensor.
  ZeRO keeps, per parameter, the elements of its flat bucket that fall into the rank's slice;
  a Gemini chunk holds a flat range of each parameter stored in it. ``local()`` is 1-D, of
  ``stop - start`` elements (or more, with padding at the end).

* :class:`Blocks`: several blocks held concatenated along one dim (a fused q/k/v projection
  split in tensor parallel keeps its slice of each of the three segments).

A module can mark a parameter it holds only a part of (:func:`mark_sharded`; tensor-parallel
layers do); :func:`sharded_view` then gives that parameter, or any tensor laid out like it
such as its gradient, as a :class:`LocalShard`, so checkpoint IO and the gradient norm treat
it as the part it is without knowing which package sharded it.

A loader reads only the stored elements of its part (``part.read(...)`` with a reader such as
``safe_open(...).get_slice``); a saver calls ``gather(dst)`` on every rank of the tensor's
group, in the same order, and only ``dst`` receives the whole tensor.

Implementations here: :class:`Replicated` (every rank holds everything; no communication)
and :class:`LocalShard` (a part held in memory, gathered over a process group). ZeRO's
optimizer states (``colossal.zero.StateRef``) and FSDP2's ``DTensor`` (an adapter in
``colossal.checkpoint_io``) implement the protocol too.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from colossal.core.comm import all_gather_object, broadcast, group_ranks, recv, send

logger = logging.getLogger(__name__)

__all__ = [
    "Block",
    "Blocks",
    "FlatRange",
    "LocalPart",
    "LocalShard",
    "Replicated",
    "ShardSpec",
    "ShardedTensor",
    "SliceReader",
    "TensorBacked",
    "mark_sharded",
    "shard_parameter",
    "shard_source",
    "shard_spec",
    "sharded_view",
]

SliceReader = Callable[[tuple[slice, ...] | None], torch.Tensor]
"""``read(index)``: the stored tensor's ``[index]`` (the whole tensor for ``None``)."""


def _shape(shape: Sequence[int]) -> tuple[int, ...]:
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
        shape = _shape(shape)
        return cls((0,) * len(shape), shape)

    @classmethod
    def along(cls, shape: Sequence[int], dim: int, start: int, stop: int) -> Block:
        """Indices ``[start, stop)`` along ``dim`` and everything along the other dims."""
        shape = _shape(shape)
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
        shape = _shape(shape)
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
        total = math.prod(_shape(shape))
        if self.stop > total:
            raise ValueError(
                f"{self} does not fit a tensor of shape {tuple(shape)} ({total} elements); "
                "describe a part of that tensor"
            )

    def is_whole(self, shape: Sequence[int]) -> bool:
        """Whether the range is every element of a tensor of ``shape``."""
        return self.start == 0 and self.stop == math.prod(_shape(shape))

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
        shape = _shape(shape)
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


LocalPart = Block | FlatRange | Blocks
"""Which part of the global tensor a rank holds."""


_SHARDED_TYPES: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()
"""Whether instances of a type are :class:`ShardedTensor` (filled by its ``isinstance``)."""


class _CheckedPerType(type(Protocol)):  # type: ignore[misc]
    """Metaclass of :class:`ShardedTensor`: ``isinstance`` is decided once per type.

    typing checks a runtime-checkable protocol by looking up each of its members on every
    call (~8 us; a save of a few hundred optimizer states spent milliseconds in it). The
    members are the type's (properties and methods), so the answer is the type's, cached.
    (No attributes here: typing would count them as members of the protocol.)
    """

    def __instancecheck__(cls, instance: object) -> bool:
        if cls is not ShardedTensor:
            return super().__instancecheck__(instance)
        kind = type(instance)
        answer = _SHARDED_TYPES.get(kind)
        if answer is None:
            answer = _SHARDED_TYPES[kind] = super().__instancecheck__(instance)
        return answer


@runtime_checkable
class ShardedTensor(Protocol, metaclass=_CheckedPerType):
    """A tensor of which this rank holds a part (see the module docstring for the layouts).

    ``gather`` is collective over the ranks that hold parts of the tensor (its group): every
    one of them calls it, in the same order relative to other gathers.
    """

    @property
    def shape(self) -> torch.Size:
        """Shape of the whole, unpadded tensor."""
        ...

    @property
    def dtype(self) -> torch.dtype:
        """Element type."""
        ...

    @property
    def part(self) -> LocalPart:
        """Which elements of the whole tensor this rank holds."""
        ...

    def local(self) -> torch.Tensor:
        """This rank's elements (shaped like ``part``; may carry padding, see the module)."""
        ...

    def gather(self, dst: int | None = None) -> torch.Tensor | None:
        """The whole tensor on global rank ``dst`` (every rank when None), None elsewhere."""
        ...


def _this_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class TensorBacked:
    """Base for a :class:`ShardedTensor` that wraps one tensor, kept as ``self.tensor``.

    ``shape`` and ``dtype`` are the wrapped tensor's (the whole tensor's, for a ``DTensor``);
    a subclass sets ``self.tensor`` and supplies ``part``, ``local`` and ``gather``.
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
    """The trivial :class:`ShardedTensor`: every rank holds the whole tensor.

    Args:
        tensor: The tensor (the same on every rank).
    """

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
        return self.tensor if dst is None or dst == _this_rank() else None

    def __repr__(self) -> str:
        return f"Replicated(shape={tuple(self.shape)}, dtype={self.dtype})"


class LocalShard:
    """A part of a tensor held in memory; the parts of a process group make up the whole.

    ``gather`` learns every rank's part (one small object all-gather), then moves only the
    parts: point to point to ``dst``, or one broadcast per holder when ``dst`` is None. The
    parts must cover the whole tensor; overlapping parts must agree (the last rank wins).

    Args:
        values: This rank's elements (shaped like ``part``, or larger with padding).
        part: Which elements of the whole tensor they are.
        shape: Shape of the whole, unpadded tensor.
        group: The ranks whose parts make up the tensor (the whole job when None).

    Raises:
        TypeError: ``values`` is not a tensor or ``part`` not a :data:`LocalPart`.
        ValueError: ``part`` does not fit ``shape`` or ``values`` cannot hold it.
    """

    def __init__(
        self,
        values: torch.Tensor,
        part: LocalPart,
        shape: Sequence[int],
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if not isinstance(values, torch.Tensor):
            raise TypeError(
                f"LocalShard values must be a torch.Tensor, got {type(values).__name__}"
            )
        if not isinstance(part, Block | FlatRange | Blocks):
            raise TypeError(
                f"part must be a Block, Blocks or FlatRange, got {type(part).__name__}"
            )
        self._shape = torch.Size(_shape(shape))
        part.check(self._shape)
        part.real(values)  # raises when values cannot hold the part
        self.values, self._part, self.group = values, part, group

    @property
    def shape(self) -> torch.Size:
        """Shape of the whole tensor."""
        return self._shape

    @property
    def dtype(self) -> torch.dtype:
        """The values' dtype."""
        return self.values.dtype

    @property
    def part(self) -> LocalPart:
        """Which elements this rank holds."""
        return self._part

    def local(self) -> torch.Tensor:
        """This rank's values."""
        return self.values

    def gather(self, dst: int | None = None) -> torch.Tensor | None:
        """The whole tensor on global rank ``dst`` (every rank when None); collective.

        Raises:
            ValueError: ``dst`` is not in the group, or the parts leave elements uncovered.
        """
        mine = self._part.real(self.values).reshape(-1).contiguous()
        if not dist.is_initialized():
            if dst not in (None, 0):
                raise ValueError(f"dst={dst} is not a rank: torch.distributed is not initialized")
            return self._assemble([(self._part, mine)])
        ranks = list(group_ranks(self.group))
        if dst is not None and dst not in ranks:
            raise ValueError(f"dst={dst} is not a rank of the tensor's group {ranks}")
        parts: list[LocalPart] = all_gather_object(self._part, self.group)
        rank = dist.get_rank()
        pieces: list[tuple[LocalPart, torch.Tensor]] = []
        for holder, part in zip(ranks, parts, strict=True):
            if part.numel == 0:
                continue
            if dst is None:
                buf = mine.clone() if holder == rank else mine.new_empty(part.numel)
                broadcast(buf, src=holder, group=self.group)
                pieces.append((part, buf))
            elif holder == rank and rank == dst:
                pieces.append((part, mine))
            elif holder == rank:
                send(mine, dst=dst, group=self.group)
            elif rank == dst:
                buf = mine.new_empty(part.numel)
                recv(buf, src=holder, group=self.group)
                pieces.append((part, buf))
        if dst is not None and rank != dst:
            return None
        return self._assemble(pieces)

    def _assemble(self, pieces: list[tuple[LocalPart, torch.Tensor]]) -> torch.Tensor:
        full = self.values.new_empty(self._shape)
        covered = torch.zeros(self._shape, dtype=torch.bool)
        for part, values in pieces:
            part.put(full, values.to(full.device))
            part.put(covered, torch.ones(part.numel, dtype=torch.bool))
        if not bool(covered.all()):
            missing = int((~covered).sum())
            raise ValueError(
                f"the parts of the group leave {missing} of {covered.numel()} elements of a "
                f"tensor of shape {tuple(self._shape)} uncovered; every element must be held "
                "by some rank"
            )
        return full

    def __repr__(self) -> str:
        return f"LocalShard(shape={tuple(self._shape)}, part={self._part}, dtype={self.dtype})"


_SPEC_ATTR = "_colossal_shard_spec"


@dataclass(frozen=True)
class ShardSpec:
    """How a marked tensor relates to the whole one (see :func:`mark_sharded`).

    Attributes:
        part: Which elements of the whole tensor the marked tensor holds.
        shape: Shape of the whole, unpadded tensor.
        group: The ranks whose parts make up the whole (None: the whole job).
    """

    part: LocalPart
    shape: torch.Size
    group: dist.ProcessGroup | None = None


def mark_sharded(
    tensor: torch.Tensor,
    part: LocalPart,
    shape: Sequence[int],
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Record on ``tensor`` (usually a parameter) that it holds ``part`` of a whole tensor.

    The record lives on the tensor object: a new tensor made from it (``.detach()``,
    ``state_dict()`` without ``keep_vars``) does not carry it.

    Args:
        tensor: The tensor this rank holds (may be larger than ``part`` with padding).
        part: Which elements of the whole tensor it holds.
        shape: Shape of the whole, unpadded tensor.
        group: The ranks whose parts make up the whole tensor (the whole job when None).

    Returns:
        ``tensor`` itself.

    Raises:
        ValueError: ``part`` does not fit ``shape`` or ``tensor`` cannot hold it.
    """
    if not isinstance(part, Block | FlatRange | Blocks):
        raise TypeError(f"part must be a Block, Blocks or FlatRange, got {type(part).__name__}")
    whole = torch.Size(_shape(shape))
    part.check(whole)
    part.real(tensor)  # raises when the tensor cannot hold the part
    setattr(tensor, _SPEC_ATTR, ShardSpec(part, whole, group))
    return tensor


def shard_spec(tensor: torch.Tensor) -> ShardSpec | None:
    """The :class:`ShardSpec` :func:`mark_sharded` recorded on ``tensor``, else None."""
    return getattr(tensor, _SPEC_ATTR, None)


def sharded_view(tensor: torch.Tensor, like: torch.Tensor | None = None) -> LocalShard | None:
    """``tensor`` as a :class:`LocalShard` when it (or ``like``) was marked, else None.

    Args:
        tensor: The values (a marked parameter, or its gradient or optimizer state).
        like: The marked tensor ``tensor`` is laid out like (``tensor`` itself when None).
    """
    spec = shard_spec(tensor if like is None else like)
    if spec is None:
        return None
    return LocalShard(tensor, spec.part, spec.shape, spec.group)


_SOURCE_ATTR = "_colossal_shard_source"


def shard_parameter(
    source: torch.Tensor,
    part: Block | Blocks,
    group: dist.ProcessGroup | None = None,
    local_shape: Sequence[int] | None = None,
    requires_grad: bool | None = None,
) -> nn.Parameter:
    """A parameter holding ``part`` of ``source`` (the whole tensor), marked sharded.

    The local tensor has ``local_shape`` (default: the part's own shape); a larger shape adds
    zero padding after the real elements (:meth:`Block.real`). When ``source`` is on the
    ``meta`` device (built under a lazy-init context) the parameter is a ``meta`` tensor too,
    and remembers ``source`` and ``part`` (:func:`shard_source`) so a materializer can build the
    whole tensor once, keep only this part and drop the rest.

    Args:
        source: The whole, unpadded tensor (a module's native weight).
        part: Which of its elements this rank keeps.
        group: The ranks whose parts make up the whole tensor (the whole job when None).
        local_shape: Shape of the local tensor, at least the part's (padding after it).
        requires_grad: Whether the parameter requires grad (default: ``source``'s flag).

    Raises:
        ValueError: ``part`` does not fit ``source`` or ``local_shape`` cannot hold it.
    """
    if not isinstance(part, Block | Blocks):
        raise TypeError(f"shard_parameter needs a Block or Blocks part, got {type(part).__name__}")
    part.check(source.shape)
    shape = tuple(part.sizes) if local_shape is None else _shape(local_shape)
    grad = source.requires_grad if requires_grad is None else requires_grad
    with torch.no_grad():
        if source.is_meta:
            local = torch.empty(shape, dtype=source.dtype, device="meta")
        else:
            local = torch.zeros(shape, dtype=source.dtype, device=source.device)
            part.real(local).copy_(part.take(source))
    param = nn.Parameter(local, requires_grad=grad)
    mark_sharded(param, part, source.shape, group)
    if source.is_meta:
        setattr(param, _SOURCE_ATTR, source)
    return param


def shard_source(tensor: torch.Tensor) -> torch.Tensor | None:
    """The whole ``meta`` tensor a :func:`shard_parameter` result was cut from, else None."""
    return getattr(tensor, _SOURCE_ATTR, None)
