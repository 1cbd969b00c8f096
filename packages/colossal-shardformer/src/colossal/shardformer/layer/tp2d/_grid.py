"""The q x q grid of 2D tensor parallelism as the layers see it.

``ParallelDims(tp=q*q, tp_mode="2d")`` arranges the tensor-parallel ranks in a grid whose
outer axis is ``tp_col`` and inner axis ``tp_row``. Rank ``(i, j)`` sits in row ``i`` and
column ``j``:

* ``i`` = ``dims.coordinate("tp_col")``: the index of the rank in its *column* group (the
  ranks ``(0..q-1, j)``, ColossalAI's ``PARALLEL_2D_COL``);
* ``j`` = ``dims.coordinate("tp_row")``: the index of the rank in its *row* group (the ranks
  ``(i, 0..q-1)``, ColossalAI's ``PARALLEL_2D_ROW``).

An activation ``X`` of shape ``(batch, ..., h)`` between 2D layers is split into ``q x q``
blocks as on the seed page: rank ``(i, j)`` holds ``X_ij``, rows (dim 0) block ``i`` and
columns (last dim) block ``j``. The seed page's input partitioning is exactly
``chunk(x, q, 0)[i]`` then ``chunk(., q, -1)[j]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch.distributed import ProcessGroup

from colossal.core import ParallelDims

__all__ = ["Grid2D", "check_part", "check_split"]


@dataclass(frozen=True)
class Grid2D:
    """This rank's place in the 2D grid of ``dims`` and the groups of its row and column.

    Attributes:
        dims: The job's parallel layout; ``tp_mode`` must be ``"2d"``.

    Raises:
        ValueError: ``dims`` is not a ParallelDims with ``tp_mode="2d"``.
    """

    dims: ParallelDims

    def __post_init__(self) -> None:
        if not isinstance(self.dims, ParallelDims) or self.dims.tp_mode != "2d":
            mode = getattr(self.dims, "tp_mode", None)
            raise ValueError(
                f"2D tensor parallel layers need ParallelDims(tp=q*q, tp_mode='2d'), got "
                f"tp_mode={mode!r}; build the layout with tp_mode='2d'"
            )

    @property
    def q(self) -> int:
        """The grid's side (``tp = q * q``)."""
        return self.dims.tp_grid_shape[0]

    @cached_property
    def i(self) -> int:
        """This rank's row index (its coordinate along ``tp_col``)."""
        return self.dims.coordinate("tp_col")

    @cached_property
    def j(self) -> int:
        """This rank's column index (its coordinate along ``tp_row``)."""
        return self.dims.coordinate("tp_row")

    @property
    def row_group(self) -> ProcessGroup:
        """The ranks ``(i, 0..q-1)`` of this rank's row (collective on first request)."""
        return self.dims.group("tp_row")

    @property
    def col_group(self) -> ProcessGroup:
        """The ranks ``(0..q-1, j)`` of this rank's column (collective on first request)."""
        return self.dims.group("tp_col")

    @cached_property
    def row_ranks(self) -> tuple[int, ...]:
        """Global ranks of ``(i, t)`` for ``t = 0..q-1`` (the row, by column index)."""
        return tuple(self.dims.ranks("tp_row"))

    @cached_property
    def col_ranks(self) -> tuple[int, ...]:
        """Global ranks of ``(t, j)`` for ``t = 0..q-1`` (the column, by row index)."""
        return tuple(self.dims.ranks("tp_col"))

    def index(self, axis: str) -> int:
        """This rank's coordinate along ``axis`` (``"tp_col"``: ``i``, ``"tp_row"``: ``j``)."""
        if axis == "tp_col":
            return self.i
        if axis == "tp_row":
            return self.j
        raise ValueError(f"unknown 2D grid axis {axis!r}; use 'tp_col' or 'tp_row'")

    def group(self, axis: str) -> ProcessGroup:
        """The group along ``axis`` (``"tp_col"``: this column, ``"tp_row"``: this row)."""
        if axis == "tp_col":
            return self.col_group
        if axis == "tp_row":
            return self.row_group
        raise ValueError(f"unknown 2D grid axis {axis!r}; use 'tp_col' or 'tp_row'")


def check_split(module: str, what: str, size: int, parts: int, grid: Grid2D, fix: str) -> None:
    """Raise ValueError unless ``size`` splits into ``parts`` (``q`` or ``q*q``) equal blocks.

    Args:
        module: The layer being built, for the message.
        what: Name of the dimension (``"out_features"``).
        size: Its size.
        parts: How many blocks it is split into.
        grid: The grid (its side is named in the message).
        fix: What the caller can do about it.
    """
    if size % parts != 0:
        q = grid.q
        how = "q" if parts == q else "q*q"
        raise ValueError(
            f"{module}: {what}={size} is not divisible by {how}={parts} (the 2D grid of "
            f"tp={grid.dims.tp} ranks has side q={q}); {fix}"
        )


def check_part(module: str, x: torch.Tensor, width: int, grid: Grid2D) -> None:
    """Raise ValueError unless ``x``'s last dim is this rank's ``width / q`` columns."""
    if x.dim() == 0 or x.shape[-1] != width // grid.q:
        raise ValueError(
            f"{module}: the input's last dim is {tuple(x.shape)[-1:]}, but this rank holds "
            f"{width // grid.q} of the {width} features (q={grid.q}); pass this rank's part "
            "of the whole activation (split_input_2d(x, dims))"
        )
