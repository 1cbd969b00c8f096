"""Metrics of ColossalAI's ``colossalai.nn.metric``."""

from colossal.legacy.nn.metric.accuracy import Accuracy, calc_acc

__all__ = ["Accuracy", "calc_acc"]
