"""Schedules: how the Engine runs a batch (ColossalAI's ``colossalai.engine.schedule``)."""

from colossal.legacy.engine.schedule.base import BaseSchedule
from colossal.legacy.engine.schedule.non_pipeline import NonPipelineSchedule
from colossal.legacy.engine.schedule.pipeline import (
    InterleavedPipelineSchedule,
    PipelineSchedule,
)

__all__ = [
    "BaseSchedule",
    "InterleavedPipelineSchedule",
    "NonPipelineSchedule",
    "PipelineSchedule",
]
