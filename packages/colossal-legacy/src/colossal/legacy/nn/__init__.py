"""ColossalAI's ``colossalai.nn`` of the config era: layers, losses, metrics, optimizers.

``colossalai.nn.Linear``, ``LayerNorm``, ``Embedding``, ``Classifier``, ``Dropout``,
``VocabParallelEmbedding``, ``VocabParallelClassifier``, ``PatchEmbedding`` build the layer
of the config's tensor mode (:mod:`colossal.legacy.nn.layer`); ``CrossEntropyLoss`` and
``VocabParallelCrossEntropyLoss`` are the mode's losses (:mod:`colossal.legacy.nn.loss`).
``colossalai.nn.Lamb`` is ``colossal.legacy.nn.Lamb``; ``colossalai.nn.metric.Accuracy`` is
``colossal.legacy.nn.metric.Accuracy`` and ``colossalai.nn.lr_scheduler`` is the
meta-package's ``colossal.nn.lr_scheduler``.
"""

from colossal.legacy.nn import layer, loss, lr_scheduler, metric, optimizer
from colossal.legacy.nn.layer import (
    Classifier,
    Dropout,
    Embedding,
    LayerNorm,
    Linear,
    PatchEmbedding,
    VocabParallelClassifier,
    VocabParallelEmbedding,
)
from colossal.legacy.nn.loss import CrossEntropyLoss, VocabParallelCrossEntropyLoss
from colossal.legacy.nn.metric import Accuracy
from colossal.legacy.nn.optimizer import Lamb

__all__ = [
    "Accuracy",
    "Classifier",
    "CrossEntropyLoss",
    "Dropout",
    "Embedding",
    "Lamb",
    "LayerNorm",
    "Linear",
    "PatchEmbedding",
    "VocabParallelClassifier",
    "VocabParallelCrossEntropyLoss",
    "VocabParallelEmbedding",
    "layer",
    "loss",
    "lr_scheduler",
    "metric",
    "optimizer",
]
