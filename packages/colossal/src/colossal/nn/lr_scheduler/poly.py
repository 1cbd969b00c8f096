"""Polynomial decay to ``end_lr``, optionally after a linear warmup."""

from __future__ import annotations

from torch.optim import Optimizer

from colossal.core import OptimizerWrapper
from colossal.nn.lr_scheduler._base import (
    ClosedFormLR,
    check_float,
    check_steps,
    warmup_lr,
)

__all__ = ["PolynomialLR", "PolynomialWarmupLR"]


def _poly(step: int, span: int, base_lr: float, end_lr: float, power: float) -> float:
    if span == 0:
        return end_lr
    return (base_lr - end_lr) * (1.0 - min(step, span) / span) ** power + end_lr


class PolynomialLR(ClosedFormLR):
    """Polynomial decay from the initial learning rate to ``end_lr`` over ``total_steps``.

    ``lr(s) = (b - end_lr) * (1 - min(s, T) / T) ** power + end_lr``, with ``s`` the step,
    ``b`` the group's initial learning rate and ``T = total_steps``.

    Args:
        optimizer: The optimizer.
        total_steps: Steps of the whole schedule (``>= 1``).
        end_lr: Final learning rate (``>= 0``).
        power: Exponent of the decay (``> 0``; 1 is linear).
        last_epoch: Index of the last step taken; -1 starts the schedule.

    Raises:
        ValueError: ``total_steps < 1``, ``end_lr < 0`` or ``power <= 0``.
    """

    def __init__(
        self,
        optimizer: Optimizer | OptimizerWrapper,
        total_steps: int,
        end_lr: float = 0.0001,
        power: float = 1.0,
        last_epoch: int = -1,
    ) -> None:
        owner = type(self).__name__
        self.total_steps, _ = check_steps(owner, total_steps)
        self.end_lr = check_float(owner, "end_lr", end_lr, 0.0)
        self.power = check_float(owner, "power", power, 0.0, exclusive_minimum=True)
        super().__init__(optimizer, last_epoch)

    def lr_at(self, step: int, base_lr: float) -> float:
        """See the class docstring."""
        return _poly(step, self.total_steps, base_lr, self.end_lr, self.power)


class PolynomialWarmupLR(ClosedFormLR):
    """Linear warmup, then polynomial decay to ``end_lr``.

    ``lr(s) = b * (s + 1) / W`` for ``s < W``, else
    ``(b - end_lr) * (1 - min(s - W, T - W) / (T - W)) ** power + end_lr`` (``end_lr`` when
    ``T == W``), with ``T = total_steps`` and ``W = warmup_steps``.

    Args:
        optimizer: The optimizer.
        total_steps: Steps of the whole schedule, warmup included (``>= 1``).
        warmup_steps: Steps of linear warmup (``0 <= warmup_steps <= total_steps``).
        end_lr: Final learning rate (``>= 0``).
        power: Exponent of the decay (``> 0``).
        last_epoch: Index of the last step taken; -1 starts the schedule.

    Raises:
        ValueError: A negative count, ``warmup_steps > total_steps``, ``end_lr < 0`` or
            ``power <= 0``.
    """

    def __init__(
        self,
        optimizer: Optimizer | OptimizerWrapper,
        total_steps: int,
        warmup_steps: int = 0,
        end_lr: float = 0.0001,
        power: float = 1.0,
        last_epoch: int = -1,
    ) -> None:
        owner = type(self).__name__
        self.total_steps, self.warmup_steps = check_steps(owner, total_steps, warmup_steps)
        self.end_lr = check_float(owner, "end_lr", end_lr, 0.0)
        self.power = check_float(owner, "power", power, 0.0, exclusive_minimum=True)
        super().__init__(optimizer, last_epoch)

    def lr_at(self, step: int, base_lr: float) -> float:
        """See the class docstring."""
        if step < self.warmup_steps:
            return warmup_lr(step, self.warmup_steps, base_lr)
        span = self.total_steps - self.warmup_steps
        return _poly(step - self.warmup_steps, span, base_lr, self.end_lr, self.power)
