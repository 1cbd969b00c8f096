"""The Engine and its parts (ColossalAI's ``colossalai.engine``).

``Engine`` composes the model, the optimizer (wrapper), the criterion, gradient handlers,
clipping and a schedule; ``initialize`` builds one from the config.
"""

from colossal.legacy.engine.engine import Engine
from colossal.legacy.engine.gradient_handler import BaseGradientHandler
from colossal.legacy.engine.schedule import (
    BaseSchedule,
    InterleavedPipelineSchedule,
    NonPipelineSchedule,
    PipelineSchedule,
)

__all__ = [
    "BaseGradientHandler",
    "BaseSchedule",
    "Engine",
    "InterleavedPipelineSchedule",
    "NonPipelineSchedule",
    "PipelineSchedule",
]
