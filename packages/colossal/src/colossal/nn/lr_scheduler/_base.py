"""What the schedulers of :mod:`colossal.nn.lr_scheduler` share: checks and a closed-form base.

A closed-form scheduler computes the learning rate of step ``s`` from ``s`` and the group's
initial learning rate alone, never from the previous learning rate. So its whole state is
``last_epoch`` plus its constructor arguments, a ``state_dict()`` round trip (also through
JSON, as the Booster saves schedulers) resumes exactly, and stepping to any ``epoch`` is exact.
"""

from __future__ import annotations

import math
from numbers import Real

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from colossal.core import OptimizerWrapper


def torch_optimizer(optimizer: object, owner: str) -> Optimizer:
    """The ``torch.optim.Optimizer`` behind ``optimizer`` (an ``OptimizerWrapper`` is unwrapped).

    Raises:
        TypeError: ``optimizer`` is neither.
    """
    if isinstance(optimizer, OptimizerWrapper):
        optimizer = optimizer.unwrap()
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"{owner}: optimizer must be a torch.optim.Optimizer (or the OptimizerWrapper "
            f"booster.boost returned), got {type(optimizer).__name__}"
        )
    return optimizer


def check_int(owner: str, name: str, value: object, minimum: int) -> int:
    """``value`` as an int, checked to be an integer ``>= minimum``.

    Raises:
        TypeError: Not an integer (``bool`` is refused too).
        ValueError: Smaller than ``minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}: {name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{owner}: {name} must be >= {minimum}, got {value}")
    return int(value)


def check_float(
    owner: str,
    name: str,
    value: object,
    minimum: float | None = None,
    maximum: float | None = None,
    *,
    exclusive_minimum: bool = False,
) -> float:
    """``value`` as a finite float within ``[minimum, maximum]`` (``(minimum, ...`` if exclusive).

    Raises:
        TypeError: Not a real number.
        ValueError: Not finite, or out of range.
    """
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{owner}: {name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{owner}: {name} must be finite, got {value}")
    too_small = minimum is not None and (value <= minimum if exclusive_minimum else value < minimum)
    if too_small:
        relation = ">" if exclusive_minimum else ">="
        raise ValueError(f"{owner}: {name} must be {relation} {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{owner}: {name} must be <= {maximum}, got {value}")
    return value


def check_steps(owner: str, total_steps: object, warmup_steps: object = 0) -> tuple[int, int]:
    """Check ``total_steps >= 1`` and ``0 <= warmup_steps <= total_steps``.

    Raises:
        TypeError: A non-integer step count.
        ValueError: Out of range; the message names both values.
    """
    total = check_int(owner, "total_steps", total_steps, 1)
    warmup = check_int(owner, "warmup_steps", warmup_steps, 0)
    if warmup > total:
        raise ValueError(
            f"{owner}: warmup_steps={warmup} is larger than total_steps={total}; the warmup "
            "is part of the schedule, so pass warmup_steps <= total_steps"
        )
    return total, warmup


def check_last_epoch(owner: str, last_epoch: object) -> int:
    """``last_epoch`` is -1 (start a new schedule) or the index of a step already taken."""
    return check_int(owner, "last_epoch", last_epoch, -1)


def warmup_lr(step: int, warmup_steps: int, base_lr: float) -> float:
    """Linear warmup: ``base_lr * (step + 1) / warmup_steps``.

    It reaches ``base_lr`` at the last warmup step, as ColossalAI's warmup schedulers do.
    """
    return base_lr * (step + 1) / warmup_steps


def cosine_lr(step: int, span: int, start: float, end: float) -> float:
    """Half a cosine from ``start`` (step 0) to ``end`` (step ``span`` and after).

    ``end + (start - end) * (1 + cos(pi * min(step, span) / span)) / 2``; ``end`` when
    ``span`` is 0.
    """
    if span <= 0:
        return end
    progress = min(step, span) / span
    return end + (start - end) * (1.0 + math.cos(math.pi * progress)) / 2.0


class ClosedFormLR(LRScheduler):
    """Base of the closed-form schedulers: subclasses define :meth:`lr_at`.

    Args:
        optimizer: The optimizer (an ``OptimizerWrapper`` is unwrapped).
        last_epoch: Index of the last step taken; -1 starts the schedule.
    """

    def __init__(self, optimizer: Optimizer | OptimizerWrapper, last_epoch: int = -1) -> None:
        owner = type(self).__name__
        last_epoch = check_last_epoch(owner, last_epoch)
        super().__init__(torch_optimizer(optimizer, owner), last_epoch)

    def lr_at(self, step: int, base_lr: float) -> float:
        """The learning rate of step ``step`` for a group starting at ``base_lr``.

        Step 0 is the rate before the first ``step()``.
        """
        raise NotImplementedError

    def get_lr(self) -> list[float]:  # type: ignore[override]
        """The learning rates of step ``last_epoch``, one per parameter group."""
        return [self.lr_at(self.last_epoch, float(base)) for base in self.base_lrs]

    def _get_closed_form_lr(self) -> list[float]:
        return self.get_lr()
