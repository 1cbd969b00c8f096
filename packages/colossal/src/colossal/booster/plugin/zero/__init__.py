"""LowLevelZeroPlugin: ZeRO-1/2 (colossal-zero) and its checkpoint IO."""

from colossal.booster.plugin.zero.checkpoint_io import ZeroCheckpointIO
from colossal.booster.plugin.zero.plugin import (
    LowLevelZeroModel,
    LowLevelZeroPlugin,
    ZeroPluginConfig,
)

__all__ = [
    "LowLevelZeroModel",
    "LowLevelZeroPlugin",
    "ZeroCheckpointIO",
    "ZeroPluginConfig",
]
