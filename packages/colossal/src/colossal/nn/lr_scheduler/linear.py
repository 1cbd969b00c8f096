"""Linear warmup followed by linear decay to 0 (ColossalAI's ``LinearWarmupLR``)."""

from __future__ import annotations

from torch.optim import Optimizer

from colossal.core import OptimizerWrapper
from colossal.nn.lr_scheduler._base import ClosedFormLR, check_steps

__all__ = ["LinearWarmupLR"]


class LinearWarmupLR(ClosedFormLR):
    """Linear warmup for ``warmup_steps``, then linear decay to 0 at ``total_steps``.

    With ``s`` the step (0 before the first ``scheduler.step()``), ``b`` the group's initial
    learning rate, ``T = total_steps`` and ``W = warmup_steps``::

        lr(s) = b * (s + 1) / (W + 1)            for s < W
        lr(s) = b * max(T - s, 0) / (T - W)      for s >= W   (0 when T == W)

    The decay starts at ``b`` at step ``W``, reaches 0 at step ``T`` and stays there.

    Args:
        optimizer: The optimizer.
        total_steps: Steps of the whole schedule, warmup included (``>= 1``).
        warmup_steps: Steps of linear warmup (``0 <= warmup_steps <= total_steps``).
        last_epoch: Index of the last step taken; -1 starts the schedule.

    Raises:
        ValueError: A negative count or ``warmup_steps > total_steps``.
    """

    def __init__(
        self,
        optimizer: Optimizer | OptimizerWrapper,
        total_steps: int,
        warmup_steps: int = 0,
        last_epoch: int = -1,
    ) -> None:
        owner = type(self).__name__
        self.total_steps, self.warmup_steps = check_steps(owner, total_steps, warmup_steps)
        super().__init__(optimizer, last_epoch)

    def lr_at(self, step: int, base_lr: float) -> float:
        """See the class docstring."""
        if step < self.warmup_steps:
            return base_lr * (step + 1) / (self.warmup_steps + 1)
        span = self.total_steps - self.warmup_steps
        if span == 0:
            return 0.0
        return base_lr * max(self.total_steps - step, 0) / span
