"""colossal-zero: ZeRO stage 1/2 optimizer that drops into any DDP training script."""

from colossal.zero.__about__ import __version__
from colossal.zero.config import ZeroConfig
from colossal.zero.memory import MemoryReport
from colossal.zero.optimizer import LowLevelZeroOptimizer

__all__ = ["LowLevelZeroOptimizer", "MemoryReport", "ZeroConfig", "__version__"]
