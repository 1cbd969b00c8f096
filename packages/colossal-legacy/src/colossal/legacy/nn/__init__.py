"""ColossalAI's ``colossalai.nn`` of the config era: losses, metrics, optimizers, schedulers.

``colossalai.nn.Lamb`` and ``colossalai.nn.CrossEntropyLoss`` are
``colossal.legacy.nn.Lamb`` and ``colossal.legacy.nn.CrossEntropyLoss``;
``colossalai.nn.metric.Accuracy`` is ``colossal.legacy.nn.metric.Accuracy`` and
``colossalai.nn.lr_scheduler`` is the meta-package's ``colossal.nn.lr_scheduler``.
"""

from colossal.legacy.nn import loss, lr_scheduler, metric, optimizer
from colossal.legacy.nn.loss import CrossEntropyLoss
from colossal.legacy.nn.metric import Accuracy
from colossal.legacy.nn.optimizer import Lamb

__all__ = ["Accuracy", "CrossEntropyLoss", "Lamb", "loss", "lr_scheduler", "metric", "optimizer"]
