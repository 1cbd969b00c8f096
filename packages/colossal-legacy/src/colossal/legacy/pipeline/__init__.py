"""Pipelining ordinary models the config-era way (``colossalai.pipeline``)."""

from colossal.legacy.pipeline.pipelinable import PipelinableContext, PipelinableModel
from colossal.legacy.pipeline.shared import (
    SHARED_GROUP_ATTR,
    PipelineSharedModuleWrapper,
    mark_stage_parameters,
    shared_parameters,
)

__all__ = [
    "SHARED_GROUP_ATTR",
    "PipelinableContext",
    "PipelinableModel",
    "PipelineSharedModuleWrapper",
    "mark_stage_parameters",
    "shared_parameters",
]
