"""Losses of ColossalAI's ``colossalai.nn.loss``."""

from colossal.legacy.nn.loss.cross_entropy import CrossEntropyLoss

__all__ = ["CrossEntropyLoss"]
