"""colossal-core: the foundation every Colossal package stands on.

Accelerator, launch, process-group mesh, coordinator, tracked communication helpers, mixed
precision, wrapper interfaces, async tensor file IO and logging.
"""

from colossal.core.__about__ import __version__
from colossal.core.accelerator import BaseAccelerator, get_accelerator
from colossal.core.accumulation import GradientAccumulator, is_accumulating
from colossal.core.comm import CommError, CommTracker
from colossal.core.coordinator import DistCoordinator
from colossal.core.grad_norm import clip_grad_norm_, grad_norm
from colossal.core.group_lifetime import keep_alive
from colossal.core.interface import ModelWrapper, OptimizerWrapper
from colossal.core.launch import (
    destroy,
    launch,
    launch_from_openmpi,
    launch_from_slurm,
    launch_from_torch,
    set_seed,
)
from colossal.core.logging import (
    DistributedLogger,
    disable_existing_loggers,
    get_dist_logger,
    get_logger,
    warn_once,
)
from colossal.core.mesh import ProcessGroupMesh
from colossal.core.parallel_dims import TP_MODES, ParallelDims
from colossal.core.precision import DynamicGradScaler, Precision, ScalerConfig, parse_precision
from colossal.core.sharded import (
    Absent,
    Block,
    Blocks,
    DTensorShard,
    FlatRange,
    ImpliedAxes,
    LocalPart,
    LocalShard,
    Nested,
    Owned,
    Placed,
    Placement,
    Replicate,
    Replicated,
    ShardedTensor,
    ShardSpec,
    TensorBacked,
    compose,
    mark_sharded,
    param_placements,
    shard_parameter,
    shard_source,
    shard_spec,
    sharded_view,
    whole_shape,
)
from colossal.core.tensor_reads import METADATA_GETTERS

__all__ = [
    "METADATA_GETTERS",
    "Absent",
    "BaseAccelerator",
    "Block",
    "Blocks",
    "DTensorShard",
    "CommError",
    "CommTracker",
    "DistCoordinator",
    "DistributedLogger",
    "DynamicGradScaler",
    "FlatRange",
    "GradientAccumulator",
    "ImpliedAxes",
    "LocalPart",
    "LocalShard",
    "ModelWrapper",
    "Nested",
    "Owned",
    "OptimizerWrapper",
    "ParallelDims",
    "TP_MODES",
    "Placed",
    "Placement",
    "Precision",
    "ProcessGroupMesh",
    "Replicate",
    "Replicated",
    "ScalerConfig",
    "ShardSpec",
    "ShardedTensor",
    "TensorBacked",
    "__version__",
    "clip_grad_norm_",
    "compose",
    "disable_existing_loggers",
    "get_accelerator",
    "get_dist_logger",
    "get_logger",
    "grad_norm",
    "is_accumulating",
    "keep_alive",
    "destroy",
    "launch",
    "launch_from_openmpi",
    "launch_from_slurm",
    "launch_from_torch",
    "mark_sharded",
    "param_placements",
    "parse_precision",
    "set_seed",
    "shard_parameter",
    "shard_source",
    "shard_spec",
    "sharded_view",
    "warn_once",
    "whole_shape",
]
