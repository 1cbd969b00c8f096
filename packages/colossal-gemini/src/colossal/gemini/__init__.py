"""colossal-gemini: chunk-based ZeRO-3 with heterogeneous (device/host) memory.

Parameters live in flat chunks sharded evenly over the data-parallel group; a chunk is
gathered before its parameters compute and released after, its gradients are reduce-scattered
as soon as they are all there, and placement policies decide which chunks and optimizer states
live on the device or on the host.
"""

from colossal.gemini.__about__ import __version__
from colossal.gemini.checkpoint import (
    ChunkGatherer,
    ChunkStateTensor,
    ChunkTensor,
    load_piece,
    model_shards,
    optimizer_shards,
    param_part,
    refresh_chunks,
)
from colossal.gemini.chunk import (
    LEGAL_TRANSITIONS,
    Chunk,
    ChunkManager,
    ChunkSearchResult,
    IllegalStateTransition,
    TensorInfo,
    TensorState,
    search_chunk_configuration,
)
from colossal.gemini.ddp import GeminiDDP, TrainableShard
from colossal.gemini.memory import (
    DEVICE_MEMORY_LIMIT_ENV,
    AutoPlacement,
    ChunkPlacement,
    DeviceMemoryBudget,
    DeviceMemoryExceeded,
    Location,
    MemStats,
    PlacementPolicy,
    RuntimeMemTracer,
    StaticPlacement,
    StepRecord,
)
from colossal.gemini.optim import GeminiOptimizer

__all__ = [
    "DEVICE_MEMORY_LIMIT_ENV",
    "LEGAL_TRANSITIONS",
    "AutoPlacement",
    "Chunk",
    "ChunkManager",
    "ChunkGatherer",
    "ChunkPlacement",
    "ChunkSearchResult",
    "ChunkStateTensor",
    "ChunkTensor",
    "DeviceMemoryBudget",
    "DeviceMemoryExceeded",
    "GeminiDDP",
    "GeminiOptimizer",
    "IllegalStateTransition",
    "Location",
    "MemStats",
    "PlacementPolicy",
    "RuntimeMemTracer",
    "StaticPlacement",
    "StepRecord",
    "TensorInfo",
    "TensorState",
    "TrainableShard",
    "__version__",
    "load_piece",
    "model_shards",
    "optimizer_shards",
    "param_part",
    "refresh_chunks",
    "search_chunk_configuration",
]
