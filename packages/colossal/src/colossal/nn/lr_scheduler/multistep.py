"""Step decays: every ``step_size`` steps, at milestones (optionally after warmup), every step."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable

from torch.optim import Optimizer

from colossal.core import OptimizerWrapper
from colossal.nn.lr_scheduler._base import (
    ClosedFormLR,
    check_float,
    check_int,
    check_steps,
    warmup_lr,
)

__all__ = ["ExponentialLR", "MultiStepLR", "MultiStepWarmupLR", "StepLR"]


def _check_milestones(owner: str, milestones: Iterable[int] | None) -> list[int]:
    if milestones is None:
        raise ValueError(
            f"{owner}: milestones is required: the increasing step indices at which the "
            "learning rate is multiplied by gamma, e.g. milestones=[30, 60]"
        )
    if isinstance(milestones, int | str | bytes):
        raise TypeError(f"{owner}: milestones must be a list of ints, got {milestones!r}")
    values = [check_int(owner, "each milestone", m, 0) for m in milestones]
    if any(a >= b for a, b in zip(values, values[1:], strict=False)):
        raise ValueError(f"{owner}: milestones must be strictly increasing, got {values}")
    return values


def _check_gamma(owner: str, gamma: object) -> float:
    return check_float(owner, "gamma", gamma, 0.0, exclusive_minimum=True)


class MultiStepLR(ClosedFormLR):
    """Multiply the initial learning rate by ``gamma`` at each milestone.

    ``lr(s) = b * gamma ** k(s)``, where ``k(s)`` is the number of milestones ``<= s``, ``s``
    the step and ``b`` the group's initial learning rate.

    Args:
        optimizer: The optimizer.
        total_steps: Steps of the whole schedule (``>= 1``; kept for ColossalAI's signature).
        milestones: Strictly increasing step indices (required).
        gamma: Factor applied at each milestone (``> 0``).
        last_epoch: Index of the last step taken; -1 starts the schedule.

    Raises:
        ValueError: Missing or unordered milestones, ``total_steps < 1`` or ``gamma <= 0``.
    """

    def __init__(
        self,
        optimizer: Optimizer | OptimizerWrapper,
        total_steps: int,
        milestones: list[int] | None = None,
        gamma: float = 0.1,
        last_epoch: int = -1,
    ) -> None:
        owner = type(self).__name__
        self.total_steps, _ = check_steps(owner, total_steps)
        self.milestones = _check_milestones(owner, milestones)
        self.gamma = _check_gamma(owner, gamma)
        super().__init__(optimizer, last_epoch)

    def lr_at(self, step: int, base_lr: float) -> float:
        """See the class docstring."""
        return base_lr * self.gamma ** bisect_right(self.milestones, step)


class MultiStepWarmupLR(ClosedFormLR):
    """Linear warmup, then multiply by ``gamma`` at each milestone after the warmup.

    ``lr(s) = b * (s + 1) / W`` for ``s < W``, else ``b * gamma ** k(s)`` where ``k(s)`` counts
    the milestones ``m`` with ``W <= m <= s``. Milestones are absolute step indices; those
    inside the warmup are ignored.

    Args:
        optimizer: The optimizer.
        total_steps: Steps of the whole schedule, warmup included (``>= 1``).
        warmup_steps: Steps of linear warmup (``0 <= warmup_steps <= total_steps``).
        milestones: Strictly increasing step indices (required).
        gamma: Factor applied at each milestone (``> 0``).
        last_epoch: Index of the last step taken; -1 starts the schedule.

    Raises:
        ValueError: A negative count, ``warmup_steps > total_steps``, missing or unordered
            milestones or ``gamma <= 0``.
    """

    def __init__(
        self,
        optimizer: Optimizer | OptimizerWrapper,
        total_steps: int,
        warmup_steps: int = 0,
        milestones: list[int] | None = None,
        gamma: float = 0.1,
        last_epoch: int = -1,
    ) -> None:
        owner = type(self).__name__
        self.total_steps, self.warmup_steps = check_steps(owner, total_steps, warmup_steps)
        self.milestones = _check_milestones(owner, milestones)
        self.gamma = _check_gamma(owner, gamma)
        super().__init__(optimizer, last_epoch)

    def lr_at(self, step: int, base_lr: float) -> float:
        """See the class docstring."""
        if step < self.warmup_steps:
            return warmup_lr(step, self.warmup_steps, base_lr)
        passed = bisect_right(self.milestones, step) - bisect_right(
            self.milestones, self.warmup_steps - 1
        )
        return base_lr * self.gamma**passed


class StepLR(ClosedFormLR):
    """Multiply the initial learning rate by ``gamma`` every ``step_size`` steps.

    ``lr(s) = b * gamma ** (s // step_size)``.

    Args:
        optimizer: The optimizer.
        total_steps: Steps of the whole schedule (``>= 1``; kept for ColossalAI's signature).
        step_size: Steps between two decays (``>= 1``).
        gamma: Factor of each decay (``> 0``).
        last_epoch: Index of the last step taken; -1 starts the schedule.

    Raises:
        ValueError: ``total_steps < 1``, ``step_size < 1`` or ``gamma <= 0``.
    """

    def __init__(
        self,
        optimizer: Optimizer | OptimizerWrapper,
        total_steps: int,
        step_size: int = 1,
        gamma: float = 0.1,
        last_epoch: int = -1,
    ) -> None:
        owner = type(self).__name__
        self.total_steps, _ = check_steps(owner, total_steps)
        self.step_size = check_int(owner, "step_size", step_size, 1)
        self.gamma = _check_gamma(owner, gamma)
        super().__init__(optimizer, last_epoch)

    def lr_at(self, step: int, base_lr: float) -> float:
        """See the class docstring."""
        return base_lr * self.gamma ** (step // self.step_size)


class ExponentialLR(ClosedFormLR):
    """Multiply the learning rate by ``gamma`` every step: ``lr(s) = b * gamma ** s``.

    Args:
        optimizer: The optimizer.
        total_steps: Steps of the whole schedule (``>= 1``; kept for ColossalAI's signature).
        gamma: Factor of each step (``> 0``; ColossalAI's default 1.0 keeps the rate).
        last_epoch: Index of the last step taken; -1 starts the schedule.

    Raises:
        ValueError: ``total_steps < 1`` or ``gamma <= 0``.
    """

    def __init__(
        self,
        optimizer: Optimizer | OptimizerWrapper,
        total_steps: int,
        gamma: float = 1.0,
        last_epoch: int = -1,
    ) -> None:
        owner = type(self).__name__
        self.total_steps, _ = check_steps(owner, total_steps)
        self.gamma = _check_gamma(owner, gamma)
        super().__init__(optimizer, last_epoch)

    def lr_at(self, step: int, base_lr: float) -> float:
        """See the class docstring."""
        return base_lr * self.gamma**step
