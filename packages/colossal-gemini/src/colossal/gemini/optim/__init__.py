"""The Gemini optimizer: the user's optimizer over the chunks' fp32 master shards."""

from colossal.gemini.optim.gemini_optimizer import GeminiOptimizer
from colossal.gemini.optim.grad_stats import GradStats
from colossal.gemini.optim.shards import MasterView

__all__ = ["GeminiOptimizer", "GradStats", "MasterView"]
