"""GeminiPlugin: chunked ZeRO-3 (colossal-gemini), its configuration and checkpoint IO."""

from colossal.booster.plugin.gemini.checkpoint_io import GeminiCheckpointIO
from colossal.booster.plugin.gemini.config import GeminiConfig, ShardformerOptions
from colossal.booster.plugin.gemini.plugin import GeminiPlugin

__all__ = [
    "GeminiCheckpointIO",
    "GeminiConfig",
    "GeminiPlugin",
    "ShardformerOptions",
]
