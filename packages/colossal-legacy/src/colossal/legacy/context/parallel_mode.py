"""ParallelMode: the names of the process groups the config-era API hands out."""

from __future__ import annotations

from enum import Enum

__all__ = ["ParallelMode"]


class ParallelMode(Enum):
    """A kind of process group, as ColossalAI's config-era API names them.

    Which ones exist in a job depends on its config (see
    :meth:`colossal.legacy.context.ParallelContext.is_initialized`): ``GLOBAL``, ``DATA``,
    ``MODEL`` and ``TENSOR`` always; ``PIPELINE`` with ``parallel=dict(pipeline=N>1)``; the
    ``PARALLEL_*`` groups with the tensor mode of the same name; ``SEQUENCE`` and
    ``SEQUENCE_DP`` with ``tensor=dict(mode='sequence')``; ``MOE_*`` with ``moe``.
    """

    GLOBAL = "global"
    DATA = "data"
    PIPELINE = "pipe"
    MODEL = "model"
    TENSOR = "tensor"
    SEQUENCE = "sequence"
    SEQUENCE_DP = "sequence_dp"
    PARALLEL_1D = "1d"
    PARALLEL_2D_ROW = "2d_row"
    PARALLEL_2D_COL = "2d_col"
    PARALLEL_3D_INPUT = "3d_input"
    PARALLEL_3D_WEIGHT = "3d_weight"
    PARALLEL_3D_OUTPUT = "3d_output"
    PARALLEL_3D_INPUT_X_WEIGHT = "3d_input_x_weight"
    PARALLEL_3D_OUTPUT_X_WEIGHT = "3d_output_x_weight"
    PARALLEL_2P5D_ROW = "2p5d_row"
    PARALLEL_2P5D_COL = "2p5d_col"
    PARALLEL_2P5D_DEP = "2p5d_dep"
    PARALLEL_2P5D_XZ = "2p5d_xz"
    MOE_MODEL = "moe_model"
    MOE_DATA = "moe_data"
