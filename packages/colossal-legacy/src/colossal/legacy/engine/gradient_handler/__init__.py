"""Gradient handlers (ColossalAI's ``colossalai.engine.gradient_handler``).

Each is registered in :data:`colossal.legacy.registry.GRADIENT_HANDLER` under its class name,
so a config can name it: ``gradient_handler = [dict(type='DataParallelGradientHandler')]``.
"""

from colossal.legacy.engine.gradient_handler.base import BaseGradientHandler
from colossal.legacy.engine.gradient_handler.data_parallel import (
    DataParallelGradientHandler,
    SequenceParallelGradientHandler,
    average_gradients,
)
from colossal.legacy.engine.gradient_handler.moe import MoeGradientHandler
from colossal.legacy.engine.gradient_handler.pipeline_shared import (
    PipelineSharedModuleGradientHandler,
)
from colossal.legacy.engine.gradient_handler.zero import ZeROGradientHandler

__all__ = [
    "BaseGradientHandler",
    "DataParallelGradientHandler",
    "MoeGradientHandler",
    "PipelineSharedModuleGradientHandler",
    "SequenceParallelGradientHandler",
    "ZeROGradientHandler",
    "average_gradients",
]
