"""Gradient accumulation (``gradient_accumulation = N`` in the config).

:func:`accumulate_gradient` wraps the optimizer, dataloader, gradient handlers and lr
scheduler so that the Engine's ``zero_grad/backward/step`` loop steps once every N batches.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TypeVar

from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from colossal.core import OptimizerWrapper
from colossal.legacy.engine.gradient_accumulation.optimizer import GradAccumOptimizer
from colossal.legacy.engine.gradient_accumulation.wrappers import (
    GradAccumDataloader,
    GradAccumGradientHandler,
    GradAccumLrSchedulerByStep,
)
from colossal.legacy.engine.gradient_handler.base import BaseGradientHandler

__all__ = [
    "GradAccumDataloader",
    "GradAccumGradientHandler",
    "GradAccumLrSchedulerByStep",
    "GradAccumOptimizer",
    "accumulate_gradient",
]


_BatchT = TypeVar("_BatchT")


def accumulate_gradient(
    model: nn.Module,
    optimizer: OptimizerWrapper | Optimizer,
    dataloader: Iterable[_BatchT] | None,
    accumulate_size: int,
    gradient_handlers: Sequence[BaseGradientHandler] | None = None,
    lr_scheduler: LRScheduler | None = None,
) -> tuple[
    GradAccumOptimizer,
    GradAccumDataloader[_BatchT] | None,
    list[BaseGradientHandler] | None,
    GradAccumLrSchedulerByStep | None,
]:
    """Wrap the training pieces to accumulate ``accumulate_size`` micro-steps per step.

    Args:
        model: The model (a DDP model skips its all-reduce until the last micro-step).
        optimizer: The optimizer (wrapper).
        dataloader: The training dataloader, or None.
        accumulate_size: Micro-steps per optimizer step.
        gradient_handlers: The engine's gradient handlers, or None.
        lr_scheduler: The lr scheduler, or None.

    Returns:
        ``(optimizer, dataloader, gradient_handlers, lr_scheduler)``, wrapped (None stays None).
    """
    optim = GradAccumOptimizer(optimizer, accumulate_size, model)
    loader = GradAccumDataloader(dataloader, accumulate_size) if dataloader is not None else None
    handlers: list[BaseGradientHandler] | None = (
        [GradAccumGradientHandler(h, accumulate_size) for h in gradient_handlers]
        if gradient_handlers is not None
        else None
    )
    scheduler = (
        GradAccumLrSchedulerByStep(lr_scheduler, accumulate_size, optim)
        if lr_scheduler is not None
        else None
    )
    return optim, loader, handlers, scheduler
