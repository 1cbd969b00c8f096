"""BaseGradientHandler: what the Engine calls on the gradients before clipping and stepping."""

from __future__ import annotations

from abc import ABC, abstractmethod

from torch import nn
from torch.optim import Optimizer

from colossal.core import OptimizerWrapper

__all__ = ["BaseGradientHandler"]


class BaseGradientHandler(ABC):
    """Synchronizes gradients after the backward (e.g. all-reduce over data parallel ranks).

    Subclass it, implement :meth:`handle_gradient`, register the class with
    ``@GRADIENT_HANDLER.register_module`` and name it in the config
    (``gradient_handler = [dict(type='MyGradientHandler')]``); ``initialize`` builds it with
    ``(model, optimizer)`` plus the dict's other keys, and ``Engine.step`` calls it before
    clipping and the optimizer step.

    Args:
        model: The model whose gradients are handled.
        optimizer: The optimizer (wrapper) that steps them.
    """

    def __init__(self, model: nn.Module, optimizer: OptimizerWrapper | Optimizer) -> None:
        self._model = model
        self._optimizer = optimizer

    @abstractmethod
    def handle_gradient(self) -> None:
        """Synchronize the gradients (collective over the handler's ranks)."""
