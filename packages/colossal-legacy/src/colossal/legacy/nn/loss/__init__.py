"""Losses of ColossalAI's ``colossalai.nn.loss``, dispatched on the tensor mode."""

from colossal.legacy.nn.loss.cross_entropy import CrossEntropyLoss
from colossal.legacy.nn.loss.moe import MoeCrossEntropyLoss, MoeLoss
from colossal.legacy.nn.loss.vocab_parallel import VocabParallelCrossEntropyLoss

__all__ = [
    "CrossEntropyLoss",
    "MoeCrossEntropyLoss",
    "MoeLoss",
    "VocabParallelCrossEntropyLoss",
]
