"""Heterogeneous memory: the device budget, the runtime memory tracer and placement policies."""

from __future__ import annotations

from colossal.gemini.memory.budget import (
    DEVICE_MEMORY_LIMIT_ENV,
    LOCATIONS,
    DeviceMemoryBudget,
    DeviceMemoryExceeded,
    Location,
    parse_memory_size,
)
from colossal.gemini.memory.placement import (
    AutoPlacement,
    ChunkLike,
    ChunkPlacement,
    PlacementPolicy,
    StaticPlacement,
)
from colossal.gemini.memory.stats import MemStats, Phase, StepRecord
from colossal.gemini.memory.tracer import RuntimeMemTracer

__all__ = [
    "AutoPlacement",
    "ChunkLike",
    "ChunkPlacement",
    "DEVICE_MEMORY_LIMIT_ENV",
    "LOCATIONS",
    "DeviceMemoryBudget",
    "DeviceMemoryExceeded",
    "Location",
    "MemStats",
    "Phase",
    "PlacementPolicy",
    "RuntimeMemTracer",
    "StaticPlacement",
    "StepRecord",
    "parse_memory_size",
]
