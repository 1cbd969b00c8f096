"""Heterogeneous memory: the device budget, the runtime memory tracer and placement policies."""

from __future__ import annotations

from colossal.gemini.memory.budget import (
    ENV_VAR,
    LOCATIONS,
    DeviceMemoryBudget,
    DeviceMemoryExceeded,
    Location,
    parse_memory_size,
)

__all__ = [
    "ENV_VAR",
    "LOCATIONS",
    "DeviceMemoryBudget",
    "DeviceMemoryExceeded",
    "Location",
    "parse_memory_size",
]
