"""Constants of the config-era API.

``INITIALIZER_MAPPING`` maps a custom tensor mode (``parallel=dict(tensor=dict(mode=...))``)
to the name of a :class:`~colossal.legacy.context.ProcessGroupInitializer` registered in
``DIST_GROUP_INITIALIZER``. The built-in modes (``1d``, ``2d``, ``2.5d``, ``3d``,
``sequence``) need no entry: their groups come from :class:`colossal.core.ParallelDims`.
"""

from __future__ import annotations

__all__ = [
    "INITIALIZER_MAPPING",
    "IS_TENSOR_PARALLEL",
    "NUM_PARTITIONS",
    "TENSOR_PARALLEL_ATTRIBUTES",
]

INITIALIZER_MAPPING: dict[str, str] = {}

#: Attribute set on a parameter that tensor parallelism splits (ColossalAI's name).
IS_TENSOR_PARALLEL = "is_tensor_parallel"
#: Attribute naming how many parts a tensor-parallel parameter is split into.
NUM_PARTITIONS = "num_partitions"
TENSOR_PARALLEL_ATTRIBUTES = (IS_TENSOR_PARALLEL, NUM_PARTITIONS)
