"""Booster plugins. Each plugin module is imported only when its name is first used."""

from __future__ import annotations

import importlib
from typing import Any

from colossal.booster.plugin.base import Boosted, Criterion, DPPluginBase, Plugin

__all__ = [
    "Boosted",
    "Criterion",
    "DPPluginBase",
    "GeminiPlugin",
    "HybridParallelPlugin",
    "LowLevelZeroPlugin",
    "MoeHybridParallelPlugin",
    "Plugin",
    "TorchDDPPlugin",
    "TorchFSDPPlugin",
]

_LAZY = {
    "TorchDDPPlugin": "colossal.booster.plugin.ddp.plugin",
    "LowLevelZeroPlugin": "colossal.booster.plugin.zero.plugin",
    "TorchFSDPPlugin": "colossal.booster.plugin.fsdp.plugin",
    "GeminiPlugin": "colossal.booster.plugin.gemini.plugin",
    "HybridParallelPlugin": "colossal.booster.plugin.hybrid.plugin",
    "MoeHybridParallelPlugin": "colossal.booster.plugin.moe_hybrid.plugin",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
