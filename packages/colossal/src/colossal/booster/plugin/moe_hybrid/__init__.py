"""MoeHybridParallelPlugin: expert parallelism x data parallelism with ZeRO over moe_dp."""

from colossal.booster.plugin.moe_hybrid.checkpoint_io import MoeCheckpointIO
from colossal.booster.plugin.moe_hybrid.plugin import MoeHybridParallelPlugin

__all__ = ["MoeCheckpointIO", "MoeHybridParallelPlugin"]
