"""The seeds' ZeRO and Gemini entry points (``colossalai.zero``)."""

from colossal.legacy.zero.gemini import PLACEMENTS, GeminiAdamOptimizer, GeminiDDP
from colossal.legacy.zero.wrappers import zero_model_wrapper, zero_optim_wrapper
from colossal.zero import LowLevelZeroOptimizer

__all__ = [
    "PLACEMENTS",
    "GeminiAdamOptimizer",
    "GeminiDDP",
    "LowLevelZeroOptimizer",
    "zero_model_wrapper",
    "zero_optim_wrapper",
]
