"""Trainer hooks of ColossalAI's ``colossalai.trainer.hooks`` (all registered in ``HOOKS``)."""

from colossal.legacy.trainer.hooks.base import BaseHook
from colossal.legacy.trainer.hooks.checkpoint_hook import SaveCheckpointHook
from colossal.legacy.trainer.hooks.log_hooks import (
    LogByEpochHook,
    LogMemoryByEpochHook,
    LogMetricByEpochHook,
    LogTimingByEpochHook,
)
from colossal.legacy.trainer.hooks.metric_hooks import (
    AccuracyHook,
    LogMetricByStepHook,
    LossHook,
    LRSchedulerHook,
    MetricHook,
    ThroughputHook,
)
from colossal.legacy.trainer.hooks.metrics import (
    AccuracyMetric,
    LearningRateMetric,
    LossMetric,
    Metric,
    ThroughputMetric,
)
from colossal.legacy.trainer.hooks.tensorboard_hook import TensorboardHook

__all__ = [
    "AccuracyHook",
    "AccuracyMetric",
    "BaseHook",
    "LRSchedulerHook",
    "LearningRateMetric",
    "LogByEpochHook",
    "LogMemoryByEpochHook",
    "LogMetricByEpochHook",
    "LogMetricByStepHook",
    "LogTimingByEpochHook",
    "LossHook",
    "LossMetric",
    "Metric",
    "MetricHook",
    "SaveCheckpointHook",
    "TensorboardHook",
    "ThroughputHook",
    "ThroughputMetric",
]
