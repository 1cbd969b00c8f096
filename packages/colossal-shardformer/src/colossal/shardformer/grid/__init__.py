"""2D, 2.5D and 3D tensor parallelism for Hugging Face models (``tensor_parallel_mode``).

A policy describes a model's transformer blocks as a :class:`GridPlan` (``Policy.grid_plan()``);
:func:`apply_grid_parallelism` replaces the blocks' linear layers, norms and dropouts with the
mode's layers (:mod:`colossal.shardformer.layer.tp2d`, ``tp2p5d``, ``tp3d``, adapted by
:mod:`.modes`), splits the hidden state entering the first block on the batch and hidden dims
and gathers it after the last (see :mod:`.apply` for where the cut lies and why).
"""

from colossal.shardformer.grid.apply import apply_grid_parallelism, check_grid_plan
from colossal.shardformer.grid.layers import GridConv1D, GridRootMeanSquareNorm
from colossal.shardformer.grid.modes import (
    GRID_MODES,
    Grid2DMode,
    Grid2p5DMode,
    Grid3DMode,
    GridMode,
    grid_mode,
)
from colossal.shardformer.grid.plan import BATCH_INPUTS, GridPlan

__all__ = [
    "BATCH_INPUTS",
    "GRID_MODES",
    "Grid2DMode",
    "Grid2p5DMode",
    "Grid3DMode",
    "GridConv1D",
    "GridMode",
    "GridPlan",
    "GridRootMeanSquareNorm",
    "apply_grid_parallelism",
    "check_grid_plan",
    "grid_mode",
]
