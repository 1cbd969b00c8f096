"""colossal-pipeline: pipeline parallelism with schedules as data.

A :class:`PipelineStageManager` places this rank on the pipeline; a schedule
(:class:`GPipeSchedule`, :class:`OneForwardOneBackwardSchedule`, :class:`InterleavedSchedule`,
:class:`ZeroBubbleVPipeScheduler`) generates a :class:`ScheduleIR` (per stage, an ordered list
of :class:`Action`), which :func:`validate_schedule` proves deadlock-free, :func:`simulate`
replays with per-action costs, and the executor runs with :class:`PipelineP2P` transfers.
"""

from colossal.pipeline.__about__ import __version__
from colossal.pipeline.generators import (
    forward_only,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    zero_bubble_v,
)
from colossal.pipeline.ir import Action, ActionType, ScheduleIR, TimelineEvent
from colossal.pipeline.layout import StageLayout, distribute_layers, stage_index
from colossal.pipeline.microbatch import split_batch
from colossal.pipeline.p2p import PipelineP2P
from colossal.pipeline.schedules import (
    GPipeSchedule,
    InterleavedSchedule,
    OneForwardOneBackwardSchedule,
    PipelineSchedule,
    ZeroBubbleVPipeScheduler,
)
from colossal.pipeline.shared import SharedParamGradSync
from colossal.pipeline.simulate import ActionCosts, SimulationResult, simulate
from colossal.pipeline.stage_manager import PipelineStageManager
from colossal.pipeline.timeline import render_text, save_png
from colossal.pipeline.v_schedule import PipelineGraph, ScheduledNode
from colossal.pipeline.validate import ScheduleValidationError, validate_schedule
from colossal.pipeline.weight_grad_store import LinearWithGradAccum, WeightGradStore

__all__ = [
    "LinearWithGradAccum",
    "PipelineGraph",
    "ScheduledNode",
    "WeightGradStore",
    "Action",
    "ActionCosts",
    "ActionType",
    "GPipeSchedule",
    "InterleavedSchedule",
    "OneForwardOneBackwardSchedule",
    "PipelineP2P",
    "PipelineSchedule",
    "PipelineStageManager",
    "ScheduleIR",
    "ScheduleValidationError",
    "SharedParamGradSync",
    "SimulationResult",
    "StageLayout",
    "TimelineEvent",
    "ZeroBubbleVPipeScheduler",
    "__version__",
    "distribute_layers",
    "forward_only",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "render_text",
    "save_png",
    "simulate",
    "split_batch",
    "stage_index",
    "validate_schedule",
    "zero_bubble_v",
]
