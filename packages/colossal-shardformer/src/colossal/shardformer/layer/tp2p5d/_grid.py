"""The d x q x q grid of 2.5D (Tesseract) tensor parallelism as the layers see it.

``ParallelDims(tp=d*q*q, tp_mode="2.5d", tp_depth=d)`` arranges the tensor-parallel ranks in
``d`` layers of a q x q grid, with the axes ``tp_dep`` (outermost), ``tp_col`` and ``tp_row``.
Rank ``(k, i, j)`` sits in layer ``k``, row ``i`` and column ``j``:

* ``k`` = ``dims.coordinate("tp_dep")``: its index in its *depth* group (the ranks
  ``(0..d-1, i, j)``, ColossalAI's ``PARALLEL_2P5D_DEP``);
* ``i`` = ``dims.coordinate("tp_col")``: its index in its *column* group (the ranks
  ``(k, 0..q-1, j)``, ``PARALLEL_2P5D_COL``);
* ``j`` = ``dims.coordinate("tp_row")``: its index in its *row* group (the ranks
  ``(k, i, 0..q-1)``, ``PARALLEL_2P5D_ROW``).

An activation ``X`` ``(batch, ..., h)`` between 2.5D layers is split as on the seed page: its
rows (dim 0) into ``d*q`` blocks, of which rank ``(k, i, j)`` holds block ``k*q + i`` (the
*row block*), and its columns (the last dim) into ``q`` blocks, of which it holds block
``j``: the seed's ``chunk(x, d, 0)[k]``, ``chunk(., q, 0)[i]``, ``chunk(., q, -1)[j]``. Each
layer ``k`` of the grid runs SUMMA on its ``q`` row blocks with the same weight blocks: a
weight is split q x q and replicated over the depth.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch.distributed import ProcessGroup

from colossal.core import ParallelDims

__all__ = ["AXES", "Grid2p5D", "check_part", "check_split"]

#: The grid's axes, outermost first, by their short names.
AXES = {"dep": "tp_dep", "col": "tp_col", "row": "tp_row"}


@dataclass(frozen=True)
class Grid2p5D:
    """This rank's place in the 2.5D grid of ``dims`` and the groups along its axes.

    Attributes:
        dims: The job's parallel layout; ``tp_mode`` must be ``"2.5d"``.

    Raises:
        ValueError: ``dims`` is not a ParallelDims with ``tp_mode="2.5d"``.
    """

    dims: ParallelDims

    def __post_init__(self) -> None:
        if not isinstance(self.dims, ParallelDims) or self.dims.tp_mode != "2.5d":
            mode = getattr(self.dims, "tp_mode", None)
            raise ValueError(
                f"2.5D tensor parallel layers need ParallelDims(tp=d*q*q, tp_mode='2.5d', "
                f"tp_depth=d), got tp_mode={mode!r}; build the layout with tp_mode='2.5d'"
            )

    @property
    def depth(self) -> int:
        """``d``, the grid's layers (ColossalAI's ``tesseract_dep``)."""
        return self.dims.tp_grid_shape[0]

    @property
    def q(self) -> int:
        """``q``, the side of each layer (ColossalAI's ``tesseract_dim``)."""
        return self.dims.tp_grid_shape[1]

    def axis(self, name: str) -> str:
        """The :class:`ParallelDims` axis of ``"dep"``, ``"col"`` or ``"row"``."""
        try:
            return AXES[name]
        except KeyError:
            raise ValueError(f"unknown 2.5D axis {name!r}; use one of {tuple(AXES)}") from None

    def group(self, *names: str) -> ProcessGroup:
        """This rank's group along the axes ``names`` (collective on first request)."""
        return self.dims.group(tuple(self.axis(n) for n in names))

    def index(self, name: str) -> int:
        """This rank's coordinate along the axis ``name``."""
        return self.dims.coordinate(self.axis(name))

    def parts(self, name: str) -> int:
        """Ranks along the axis ``name``."""
        return self.depth if name == "dep" else self.q

    @cached_property
    def k(self) -> int:
        """This rank's layer (its coordinate along ``tp_dep``)."""
        return self.index("dep")

    @cached_property
    def i(self) -> int:
        """This rank's row in its layer (its coordinate along ``tp_col``)."""
        return self.index("col")

    @cached_property
    def j(self) -> int:
        """This rank's column in its layer (its coordinate along ``tp_row``)."""
        return self.index("row")

    @property
    def row_blocks(self) -> int:
        """The blocks an activation's rows are split into: ``d*q``."""
        return self.depth * self.q

    @property
    def row_block(self) -> int:
        """This rank's block of an activation's rows: ``k*q + i``."""
        return self.k * self.q + self.i


def check_split(module: str, what: str, size: int, parts: int, grid: Grid2p5D, fix: str) -> None:
    """Raise ValueError unless ``size`` splits into ``parts`` equal blocks on ``grid``.

    Args:
        module: The layer being built, for the message.
        what: Name of the dimension (``"out_features"``).
        size: Its size.
        parts: How many blocks it is split into.
        grid: The grid (its sizes are named in the message).
        fix: What the caller can do about it.
    """
    if size % parts:
        raise ValueError(
            f"{module}: {what}={size} is not divisible by {parts} (the 2.5D grid of "
            f"tp={grid.dims.tp} ranks has depth d={grid.depth}, side q={grid.q}); {fix}"
        )


def check_part(module: str, x: torch.Tensor, width: int, grid: Grid2p5D) -> None:
    """Raise ValueError unless ``x``'s last dim is this rank's ``width / q`` columns."""
    if x.dim() == 0 or x.shape[-1] != width // grid.q:
        raise ValueError(
            f"{module}: the input's last dim is {tuple(x.shape)[-1:]}, but this rank holds "
            f"{width // grid.q} of the {width} features (q={grid.q}); pass this rank's part "
            "of the whole activation (split_input_2p5d(x, dims))"
        )
