"""colossal.booster: the Booster API (ColossalAI-compatible) and its plugins.

Plugins load lazily: ``import colossal.booster`` imports none of gemini, shardformer or
transformers.

Example:
    >>> from colossal.booster import Booster
    >>> from colossal.booster.plugin import TorchDDPPlugin
    >>> booster = Booster(plugin=TorchDDPPlugin())
"""

from __future__ import annotations

import importlib
from typing import Any

from colossal.booster.__about__ import __version__
from colossal.booster.booster import Booster
from colossal.booster.mixed_precision import (
    AutocastModel,
    BF16MixedPrecision,
    FP8MixedPrecision,
    FP16ApexMixedPrecision,
    FP16NaiveMixedPrecision,
    FP16TorchMixedPrecision,
    MixedPrecision,
    MixedPrecisionOptimizer,
)
from colossal.booster.plugin import Boosted, Criterion, DPPluginBase, Plugin

__all__ = [
    "AutocastModel",
    "BF16MixedPrecision",
    "Boosted",
    "Booster",
    "Criterion",
    "DPPluginBase",
    "FP8MixedPrecision",
    "FP16ApexMixedPrecision",
    "FP16NaiveMixedPrecision",
    "FP16TorchMixedPrecision",
    "GeminiPlugin",
    "HybridParallelPlugin",
    "LowLevelZeroPlugin",
    "MixedPrecision",
    "MixedPrecisionOptimizer",
    "MoeHybridParallelPlugin",
    "Plugin",
    "TorchDDPPlugin",
    "TorchFSDPPlugin",
    "__version__",
]

_PLUGINS = (
    "GeminiPlugin",
    "HybridParallelPlugin",
    "LowLevelZeroPlugin",
    "MoeHybridParallelPlugin",
    "TorchDDPPlugin",
    "TorchFSDPPlugin",
)


def __getattr__(name: str) -> Any:
    if name in _PLUGINS:
        return getattr(importlib.import_module("colossal.booster.plugin"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
