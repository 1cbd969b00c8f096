"""Where each offloaded param's optimizer state lives in the state file.

The file is a sequence of *units*, each read and written whole by one IO call. A unit holds
*pieces*: consecutive elements of one param's ``exp_avg`` followed by the same elements of
its ``exp_avg_sq``. Params are packed in update order and split across units where needed,
so units are all about the same size: a huge embedding does not need a huge buffer (the ring
of buffers holds a few units, not a few of the largest params), and small params (biases,
norms) share one IO call instead of paying one each.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from colossal.core.io import ALIGNMENT

BLOCK = ALIGNMENT // 4
"""fp32 elements per alignment block: units start and end on block boundaries."""

_PIECE_ALIGN = 16  # fp32 elements (64 bytes) between pieces: vector loads stay aligned
_SPLIT = 16
"""A param is split at multiples of this many elements: the CPU kernel vectorises 16 at a
time from a tensor's start, so each element of a piece takes the same (vector or scalar tail)
path as in the whole param, and results stay bit-identical."""


def padded(numel: int, multiple: int = BLOCK) -> int:
    """``numel`` rounded up to a multiple of ``multiple``."""
    return -(-numel // multiple) * multiple


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of the param with ``key``, at ``offset`` in its unit.

    The unit's buffer holds ``exp_avg`` of those elements at ``offset`` and ``exp_avg_sq``
    right after it.
    """

    key: int
    start: int
    stop: int
    offset: int

    @property
    def numel(self) -> int:
        """Elements of the param in this piece."""
        return self.stop - self.start


@dataclass
class Unit:
    """One IO call's worth of state: ``numel`` fp32 values at byte ``offset`` of the file."""

    offset: int
    numel: int = 0
    pieces: list[Piece] = field(default_factory=list)
    written: bool = False  # the file holds this unit (else it reads as zeros)

    @property
    def nbytes(self) -> int:
        """Bytes of the unit in the file (whole alignment blocks)."""
        return 4 * padded(self.numel)


class StateLayout:
    """Packs params' states into units of at most ``capacity`` fp32 values, in order.

    Args:
        capacity: fp32 values per unit (``exp_avg`` and ``exp_avg_sq`` together), rounded
            up to whole alignment blocks.

    Raises:
        ValueError: ``capacity`` is below one block.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < BLOCK:
            raise ValueError(f"capacity={capacity} is below one block of {BLOCK} values")
        self.capacity = padded(capacity)
        self.units: list[Unit] = []
        self._pieces: dict[int, list[tuple[Unit, Piece]]] = {}

    def add(self, key: int, numel: int) -> None:
        """Append the state of param ``key`` with ``numel`` elements.

        Raises:
            ValueError: ``key`` was added before.
        """
        if key in self._pieces:
            raise ValueError(f"param key {key} already has a place in the state file")
        placed: list[tuple[Unit, Piece]] = []
        start = 0
        while start < numel or not placed:
            unit = self.units[-1] if self.units else None
            room = (self.capacity - unit.numel) // 2 if unit is not None else 0
            room -= room % _SPLIT
            if unit is None or room <= 0:
                offset = self.units[-1].offset + self.units[-1].nbytes if self.units else 0
                unit = Unit(offset)
                self.units.append(unit)
                continue
            stop = min(numel, start + room)
            piece = Piece(key, start, stop, unit.numel)
            unit.pieces.append(piece)
            unit.numel += padded(2 * piece.numel, _PIECE_ALIGN)
            placed.append((unit, piece))
            start = stop
        self._pieces[key] = placed

    def pieces(self, key: int) -> list[tuple[Unit, Piece]]:
        """The units and pieces holding param ``key``'s state, in element order."""
        return self._pieces[key]

    def units_of(self, keys: set[int]) -> Iterator[Unit]:
        """The units holding any of ``keys``, in file order."""
        for unit in self.units:
            if any(p.key in keys for p in unit.pieces):
                yield unit

    @property
    def file_nbytes(self) -> int:
        """Size of the state file once every unit is written."""
        return self.units[-1].offset + self.units[-1].nbytes if self.units else 0
