"""The sharded-state protocol: "a tensor of which this rank holds a part".

Checkpoint IO and the gradient norm speak only to :class:`ShardedTensor`, whatever
parallelism produced the part. An implementation says what the whole tensor is (``shape``
and ``dtype``, unpadded), how it is placed along each parallel axis (``placements``,
outermost first, see :mod:`colossal.core.sharded.placement`), which elements of the whole
tensor that leaves this rank (``part``, the placements composed), gives its local tensor
(``local()``) and gathers the whole tensor to one named rank (``gather(dst)``).

:class:`Placed` is the base of implementations: given ``placements`` and ``local()`` it
supplies ``part`` and a ``gather`` that walks the axes (:func:`gather_placed`); an
implementation that can gather its innermost axis faster (a Gemini chunk, a ZeRO bucket)
overrides :meth:`Placed.gather_inner`.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from colossal.core.sharded.gather import gather_placed
from colossal.core.sharded.placement import LocalPart, Placement, compose

__all__ = ["Placed", "ShardedTensor"]

_SHARDED_TYPES: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()
"""Whether instances of a type are :class:`ShardedTensor` (filled by its ``isinstance``)."""


class _CheckedPerType(type(Protocol)):  # type: ignore[misc]
    """Metaclass of :class:`ShardedTensor`: ``isinstance`` is decided once per type.

    typing checks a runtime-checkable protocol by looking up each of its members on every
    call; the members are the type's (properties and methods), so the answer is the type's,
    cached. (No attributes here: typing would count them as members of the protocol.)
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
    """A tensor of which this rank holds a part, placed along each parallel axis.

    ``gather`` is collective over the ranks of the tensor's placements: every one of them
    calls it, in the same order relative to other gathers.
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
    def placements(self) -> tuple[Placement, ...]:
        """How the tensor is placed along each parallel axis, outermost first."""
        ...

    @property
    def part(self) -> LocalPart:
        """Which elements of the whole tensor this rank holds (the placements composed)."""
        ...

    def local(self) -> torch.Tensor:
        """This rank's elements (shaped like ``part``; may carry padding)."""
        ...

    def gather(self, dst: int | None = None) -> torch.Tensor | None:
        """The whole tensor on global rank ``dst`` (every rank when None), None elsewhere."""
        ...


class Placed:
    """Base of a :class:`ShardedTensor` known by its placements and local tensor.

    A subclass provides ``shape``, ``dtype``, ``placements`` and ``local()``; ``part`` and
    ``gather`` follow from them. The composed part is computed once per placements.
    """

    _part_cache: tuple[tuple[Placement, ...], torch.Size, LocalPart] | None = None

    @property
    def shape(self) -> torch.Size:  # pragma: no cover - provided by subclasses
        """Shape of the whole, unpadded tensor."""
        raise NotImplementedError

    @property
    def dtype(self) -> torch.dtype:  # pragma: no cover - provided by subclasses
        """Element type."""
        raise NotImplementedError

    @property
    def placements(self) -> tuple[Placement, ...]:  # pragma: no cover - provided by subclasses
        """How the tensor is placed along each parallel axis, outermost first."""
        raise NotImplementedError

    def local(self) -> torch.Tensor:  # pragma: no cover - provided by subclasses
        """This rank's elements."""
        raise NotImplementedError

    @property
    def part(self) -> LocalPart:
        """The placements composed into one part of the whole tensor."""
        placements, shape = self.placements, self.shape
        cached = self._part_cache
        if cached is None or cached[0] is not placements or cached[1] != shape:
            cached = (placements, shape, compose(placements, shape))
            self._part_cache = cached
        return cached[2]

    def along(self, placement: Placement) -> Placed:
        """A copy of this tensor placed as ``placement`` along its axis.

        The placement replaces the one along the same axis, or becomes the outermost. The
        copy shares the local tensor (a save may describe a pipeline stage's ownership of a
        tied weight differently from how the norm counts it).

        Raises:
            TypeError: The implementation keeps its placements elsewhere than ``_placements``.
        """
        if not hasattr(self, "_placements"):
            raise TypeError(f"{type(self).__name__} cannot be re-placed (no _placements)")
        old = self.placements
        axes = [p.axis for p in old]
        if placement.axis in axes:
            at = axes.index(placement.axis)
            new = (*old[:at], placement, *old[at + 1 :])
        else:
            new = (placement, *old)
        clone = copy.copy(self)
        clone._placements = new
        return clone

    def holds(self) -> bool:
        """Whether this rank holds the tensor's values (False for an owned axis' others)."""
        return True

    def gather_inner(self, leader: int | None) -> torch.Tensor | None:
        """Gather the innermost splitting axis to ``leader``; None: use the generic exchange."""
        raise NotImplementedError

    def gather(self, dst: int | None = None) -> torch.Tensor | None:
        """The whole tensor on global rank ``dst`` (every rank when None); collective."""
        inner = None
        if type(self).gather_inner is not Placed.gather_inner:
            inner = self.gather_inner
        values = self.local() if self.holds() else None
        return gather_placed(values, self.placements, self.shape, self.dtype, dst, inner)


def placements_of(value: Sequence[Placement] | Placement) -> tuple[Placement, ...]:
    """``value`` as a tuple of placements (one placement is a tuple of one)."""
    if isinstance(value, Placement):
        return (value,)
    out = tuple(value)
    for p in out:
        if not isinstance(p, Placement):
            raise TypeError(
                f"expected a Block, Blocks or FlatRange part or Placement objects, got "
                f"{type(p).__name__}"
            )
    return out
