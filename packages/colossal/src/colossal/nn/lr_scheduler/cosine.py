"""Cosine schedules: plain, after a linear warmup, and after a flat stretch.

Notation of the formulas: ``s`` is the step (``last_epoch``: 0 before the first
``scheduler.step()``), ``b`` the group's initial learning rate, ``T`` ``total_steps``,
``W`` ``warmup_steps`` and
``cos_from_to(t, n, x, y) = y + (x - y) * (1 + cos(pi * min(t, n) / n)) / 2`` (``y`` when
``n == 0``). Every schedule holds its last value after ``T`` steps.
"""

from __future__ import annotations

from torch.optim import Optimizer

from colossal.core import OptimizerWrapper
from colossal.nn.lr_scheduler._base import (
    ClosedFormLR,
    check_float,
    check_steps,
    cosine_lr,
    warmup_lr,
)

__all__ = [
    "CosineAnnealingLR",
    "CosineAnnealingWarmupLR",
    "FlatAnnealingLR",
    "FlatAnnealingWarmupLR",
]


def _check_pct_start(owner: str, pct_start: object) -> float:
    return check_float(owner, "pct_start", pct_start, 0.0, 1.0)


class CosineAnnealingLR(ClosedFormLR):
    """Cosine annealing from the initial learning rate to ``eta_min`` over ``total_steps``.

    ``lr(s) = cos_from_to(s, T, b, eta_min)``: ``b`` at step 0, ``eta_min`` at step ``T``, and
    ``eta_min`` after it (``torch.optim.lr_scheduler.CosineAnnealingLR`` would rise again).

    Args:
        optimizer: The optimizer.
        total_steps: Steps of the whole schedule (``>= 1``).
        eta_min: Final learning rate (``>= 0``).
        last_epoch: Index of the last step taken; -1 starts the schedule.

    Raises:
        ValueError: ``total_steps < 1`` or ``eta_min < 0``.
    """

    def __init__(
        self,
        optimizer: Optimizer | OptimizerWrapper,
        total_steps: int,
        eta_min: float = 0.0,
        last_epoch: int = -1,
    ) -> None:
        owner = type(self).__name__
        self.total_steps, _ = check_steps(owner, total_steps)
        self.eta_min = check_float(owner, "eta_min", eta_min, 0.0)
        super().__init__(optimizer, last_epoch)

    def lr_at(self, step: int, base_lr: float) -> float:
        """``cos_from_to(step, T, base_lr, eta_min)``."""
        return cosine_lr(step, self.total_steps, base_lr, self.eta_min)


class CosineAnnealingWarmupLR(ClosedFormLR):
    """Linear warmup for ``warmup_steps``, then cosine annealing to ``eta_min``.

    ``lr(s) = b * (s + 1) / W`` for ``s < W``, else ``cos_from_to(s - W, T - W, b, eta_min)``.
    So the warmup reaches ``b`` at step ``W - 1``, the cosine starts at ``b`` at step ``W`` and
    ends at ``eta_min`` at step ``T``.

    Args:
        optimizer: The optimizer.
        total_steps: Steps of the whole schedule, warmup included (``>= 1``).
        warmup_steps: Steps of linear warmup (``0 <= warmup_steps <= total_steps``).
        eta_min: Final learning rate (``>= 0``).
        last_epoch: Index of the last step taken; -1 starts the schedule.

    Raises:
        ValueError: A negative count, ``warmup_steps > total_steps`` or ``eta_min < 0``.
    """

    def __init__(
        self,
        optimizer: Optimizer | OptimizerWrapper,
        total_steps: int,
        warmup_steps: int = 0,
        eta_min: float = 0.0,
        last_epoch: int = -1,
    ) -> None:
        owner = type(self).__name__
        self.total_steps, self.warmup_steps = check_steps(owner, total_steps, warmup_steps)
        self.eta_min = check_float(owner, "eta_min", eta_min, 0.0)
        super().__init__(optimizer, last_epoch)

    def lr_at(self, step: int, base_lr: float) -> float:
        """Warmup, then ``cos_from_to(step - W, T - W, base_lr, eta_min)``."""
        if step < self.warmup_steps:
            return warmup_lr(step, self.warmup_steps, base_lr)
        span = self.total_steps - self.warmup_steps
        return cosine_lr(step - self.warmup_steps, span, base_lr, self.eta_min)


class FlatAnnealingLR(ClosedFormLR):
    """A flat initial learning rate, then cosine annealing to 0.

    The rate stays flat for ``F = int(total_steps * pct_start)`` steps.
    ``lr(s) = b`` for ``s < F``, else ``cos_from_to(s - F, T - F, b, 0)``.

    Args:
        optimizer: The optimizer.
        total_steps: Steps of the whole schedule (``>= 1``).
        pct_start: Fraction of the steps before the decay starts (``0 <= pct_start <= 1``).
        last_epoch: Index of the last step taken; -1 starts the schedule.

    Raises:
        ValueError: ``total_steps < 1`` or ``pct_start`` outside ``[0, 1]``.
    """

    def __init__(
        self,
        optimizer: Optimizer | OptimizerWrapper,
        total_steps: int,
        pct_start: float = 0.72,
        last_epoch: int = -1,
    ) -> None:
        owner = type(self).__name__
        self.total_steps, _ = check_steps(owner, total_steps)
        self.pct_start = _check_pct_start(owner, pct_start)
        self.flat_steps = int(self.total_steps * self.pct_start)
        super().__init__(optimizer, last_epoch)

    def lr_at(self, step: int, base_lr: float) -> float:
        """``base_lr`` while flat, then ``cos_from_to(step - F, T - F, base_lr, 0)``."""
        if step < self.flat_steps:
            return base_lr
        return cosine_lr(step - self.flat_steps, self.total_steps - self.flat_steps, base_lr, 0.0)


class FlatAnnealingWarmupLR(ClosedFormLR):
    """Linear warmup, a flat stretch, then cosine annealing to ``eta_min``.

    With ``F = int((T - W) * pct_start)``: ``lr(s) = b * (s + 1) / W`` for ``s < W``; ``b`` for
    ``W <= s < W + F``; else ``cos_from_to(s - W - F, T - W - F, b, eta_min)``.

    Args:
        optimizer: The optimizer.
        total_steps: Steps of the whole schedule, warmup included (``>= 1``).
        warmup_steps: Steps of linear warmup (``0 <= warmup_steps <= total_steps``).
        pct_start: Fraction of the steps after the warmup that stay flat (``[0, 1]``).
        eta_min: Final learning rate (``>= 0``).
        last_epoch: Index of the last step taken; -1 starts the schedule.

    Raises:
        ValueError: A negative count, ``warmup_steps > total_steps``, ``pct_start`` outside
            ``[0, 1]`` or ``eta_min < 0``.
    """

    def __init__(
        self,
        optimizer: Optimizer | OptimizerWrapper,
        total_steps: int,
        warmup_steps: int = 0,
        pct_start: float = 0.72,
        eta_min: float = 0.0,
        last_epoch: int = -1,
    ) -> None:
        owner = type(self).__name__
        self.total_steps, self.warmup_steps = check_steps(owner, total_steps, warmup_steps)
        self.pct_start = _check_pct_start(owner, pct_start)
        self.eta_min = check_float(owner, "eta_min", eta_min, 0.0)
        self.flat_steps = int((self.total_steps - self.warmup_steps) * self.pct_start)
        super().__init__(optimizer, last_epoch)

    def lr_at(self, step: int, base_lr: float) -> float:
        """Warmup, flat, then ``cos_from_to(step - W - F, T - W - F, base_lr, eta_min)``."""
        if step < self.warmup_steps:
            return warmup_lr(step, self.warmup_steps, base_lr)
        decay_start = self.warmup_steps + self.flat_steps
        if step < decay_start:
            return base_lr
        span = self.total_steps - decay_start
        return cosine_lr(step - decay_start, span, base_lr, self.eta_min)
