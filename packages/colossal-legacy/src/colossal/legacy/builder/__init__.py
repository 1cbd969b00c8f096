"""Pipeline model builders of the config-era API (``colossalai.builder``)."""

from colossal.legacy.builder.partition import partition_balanced, partition_uniform
from colossal.legacy.builder.pipeline import (
    build_layer,
    build_pipeline_model,
    build_pipeline_model_from_cfg,
)

__all__ = [
    "build_layer",
    "build_pipeline_model",
    "build_pipeline_model_from_cfg",
    "partition_balanced",
    "partition_uniform",
]
