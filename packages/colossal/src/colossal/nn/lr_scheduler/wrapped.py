"""ColossalAI's signatures over torch's ``LambdaLR``, ``MultiplicativeLR`` and ``OneCycleLR``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

from torch.optim import Optimizer
from torch.optim import lr_scheduler as torch_sched

from colossal.core import OptimizerWrapper
from colossal.nn.lr_scheduler._base import (
    check_float,
    check_last_epoch,
    check_steps,
    torch_optimizer,
)

__all__ = ["LambdaLR", "MultiplicativeLR", "OneCycleLR"]

LrLambda = Callable[[int], float] | Sequence[Callable[[int], float]]
"""A function of the step returning a factor, or one such function per parameter group."""

_TorchLrLambda = Callable[[int], float] | list[Callable[[int], float]]


def _check_lambda(owner: str, lr_lambda: LrLambda | None) -> _TorchLrLambda:
    if lr_lambda is None:
        raise ValueError(
            f"{owner}: lr_lambda is required: a function of the step returning a factor (or "
            "one function per parameter group), e.g. lr_lambda=lambda step: 0.95 ** step"
        )
    return lr_lambda if callable(lr_lambda) else list(lr_lambda)


def _lambda_arguments(
    scheduler: LambdaLR | MultiplicativeLR,
    optimizer: Optimizer | OptimizerWrapper,
    total_steps: int,
    lr_lambda: LrLambda | None,
    last_epoch: int,
) -> tuple[Optimizer, _TorchLrLambda, int]:
    """Check the arguments shared by ``LambdaLR`` and ``MultiplicativeLR``.

    Sets ``scheduler.total_steps`` and returns what the torch scheduler takes.
    """
    owner = type(scheduler).__name__
    scheduler.total_steps, _ = check_steps(owner, total_steps)
    return (
        torch_optimizer(optimizer, owner),
        _check_lambda(owner, lr_lambda),
        check_last_epoch(owner, last_epoch),
    )


class LambdaLR(torch_sched.LambdaLR):
    """``lr(s) = b * lr_lambda(s)`` (``torch.optim.lr_scheduler.LambdaLR``).

    Only callable objects (not plain functions or lambdas) are part of ``state_dict()``; a
    resumed scheduler must be built with the same ``lr_lambda``.

    Args:
        optimizer: The optimizer.
        total_steps: Steps of the whole schedule (``>= 1``; kept for ColossalAI's signature).
        lr_lambda: A function of the step, or one per parameter group (required).
        last_epoch: Index of the last step taken; -1 starts the schedule.

    Raises:
        ValueError: ``lr_lambda`` missing or ``total_steps < 1``.
    """

    total_steps: int

    def __init__(
        self,
        optimizer: Optimizer | OptimizerWrapper,
        total_steps: int,
        lr_lambda: LrLambda | None = None,
        last_epoch: int = -1,
    ) -> None:
        optim, checked, last = _lambda_arguments(
            self, optimizer, total_steps, lr_lambda, last_epoch
        )
        super().__init__(optim, checked, last_epoch=last)


class MultiplicativeLR(torch_sched.MultiplicativeLR):
    """``lr(s) = lr(s - 1) * lr_lambda(s)`` for ``s >= 1`` (torch's ``MultiplicativeLR``).

    Args:
        optimizer: The optimizer.
        total_steps: Steps of the whole schedule (``>= 1``; kept for ColossalAI's signature).
        lr_lambda: A function of the step, or one per parameter group (required).
        last_epoch: Index of the last step taken; -1 starts the schedule.

    Raises:
        ValueError: ``lr_lambda`` missing or ``total_steps < 1``.
    """

    total_steps: int

    def __init__(
        self,
        optimizer: Optimizer | OptimizerWrapper,
        total_steps: int,
        lr_lambda: LrLambda | None = None,
        last_epoch: int = -1,
    ) -> None:
        optim, checked, last = _lambda_arguments(
            self, optimizer, total_steps, lr_lambda, last_epoch
        )
        super().__init__(optim, checked, last_epoch=last)


class OneCycleLR(torch_sched.OneCycleLR):
    """torch's 1cycle policy (``OneCycleLR``), peaking at each group's learning rate.

    ``max_lr`` is each group's learning rate when the scheduler is created.

    With ``p = pct_start * T - 1``, ``a = max_lr / div_factor`` and
    ``z = a / final_div_factor`` (two phases, ``anneal_strategy='cos'``):
    ``lr(s) = anneal(a, max_lr, s / p)`` for ``s <= p``, else
    ``anneal(max_lr, z, (s - p) / (T - 1 - p))``, where
    ``anneal(x, y, f) = y + (x - y) * (1 + cos(pi * f)) / 2`` (``x + (y - x) * f`` for
    ``'linear'``). Momentum (or Adam's beta1) cycles inversely when ``cycle_momentum``.
    Stepping past ``total_steps`` raises, as in torch.

    Args:
        optimizer: The optimizer.
        total_steps: Steps of the cycle (``>= 1``).
        pct_start: Fraction of the cycle spent increasing the rate (``0 < pct_start < 1``).
        anneal_strategy: ``'cos'`` or ``'linear'``.
        cycle_momentum: Cycle momentum inversely to the rate.
        base_momentum: Momentum at the peak rate.
        max_momentum: Momentum at the start and end of the cycle.
        div_factor: ``initial_lr = max_lr / div_factor``.
        final_div_factor: ``min_lr = initial_lr / final_div_factor``.
        last_epoch: Index of the last step taken; -1 starts the schedule.
        three_phase: Use the paper's three phases instead of fastai's two.

    Raises:
        ValueError: Out-of-range arguments (torch's checks name them).
    """

    def __init__(
        self,
        optimizer: Optimizer | OptimizerWrapper,
        total_steps: int,
        pct_start: float = 0.3,
        anneal_strategy: Literal["cos", "linear"] = "cos",
        cycle_momentum: bool = True,
        base_momentum: float = 0.85,
        max_momentum: float = 0.95,
        div_factor: float = 25.0,
        final_div_factor: float = 10000.0,
        last_epoch: int = -1,
        three_phase: bool = False,
    ) -> None:
        owner = type(self).__name__
        total, _ = check_steps(owner, total_steps)
        optim = torch_optimizer(optimizer, owner)
        last_epoch = check_last_epoch(owner, last_epoch)
        check_float(owner, "div_factor", div_factor, 0.0, exclusive_minimum=True)
        check_float(owner, "final_div_factor", final_div_factor, 0.0, exclusive_minimum=True)
        key = "lr" if last_epoch == -1 else "max_lr"
        max_lrs = [float(group[key]) for group in optim.param_groups]
        super().__init__(
            optim, max_lrs, total_steps=total, pct_start=pct_start,
            anneal_strategy=anneal_strategy,
            cycle_momentum=cycle_momentum, base_momentum=base_momentum,
            max_momentum=max_momentum, div_factor=div_factor,
            final_div_factor=final_div_factor, three_phase=three_phase, last_epoch=last_epoch,
        )  # fmt: skip
