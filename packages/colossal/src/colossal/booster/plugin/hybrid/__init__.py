"""HybridParallelPlugin: tensor x sequence x pipeline x data parallelism, its checkpoint IO."""

from colossal.booster.plugin.hybrid.checkpoint_io import HybridCheckpointIO
from colossal.booster.plugin.hybrid.config import HybridConfig
from colossal.booster.plugin.hybrid.model import HybridParallelModel
from colossal.booster.plugin.hybrid.plugin import HybridParallelPlugin

__all__ = [
    "HybridCheckpointIO",
    "HybridConfig",
    "HybridParallelModel",
    "HybridParallelPlugin",
]
