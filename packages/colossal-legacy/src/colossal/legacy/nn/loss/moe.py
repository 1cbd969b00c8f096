"""``MoeLoss``: a loss plus ``aux_weight`` times the MoE layers' auxiliary loss."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from colossal.legacy.context.moe_context import moe_env

__all__ = ["MoeCrossEntropyLoss", "MoeLoss"]


class MoeLoss(nn.Module):
    """``loss_fn(*args, **kwargs)(...) + aux_weight * moe_env.get_loss()`` (ColossalAI's).

    The auxiliary losses the MoE layers added during the forward are read and cleared, so
    each step adds its own forward's only.

    Args:
        aux_weight: Weight of the auxiliary (load-balancing) loss, e.g. 0.01.
        loss_fn: The main loss class (e.g. ``nn.CrossEntropyLoss``) or a built loss.
        *args: Passed to ``loss_fn`` when it is a class.
        **kwargs: Passed to ``loss_fn`` when it is a class (e.g. ``label_smoothing=0.1``).

    Raises:
        ValueError: ``aux_weight`` is negative or not a number.
        TypeError: ``loss_fn`` is not callable.
    """

    def __init__(
        self,
        aux_weight: float,
        loss_fn: type[nn.Module] | Callable[..., torch.Tensor],
        *args: object,
        **kwargs: object,
    ) -> None:
        super().__init__()
        if isinstance(aux_weight, bool) or not isinstance(aux_weight, (int, float)):
            raise ValueError(f"aux_weight must be a number >= 0, got {aux_weight!r}")
        if aux_weight < 0:
            raise ValueError(f"aux_weight must be >= 0, got {aux_weight}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be a loss class or callable, got {loss_fn!r}")
        self.aux_weight = float(aux_weight)
        built = loss_fn(*args, **kwargs) if isinstance(loss_fn, type) else loss_fn
        self.loss_fn = built

    def forward(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        """The main loss plus ``aux_weight`` times the pending auxiliary loss (then cleared)."""
        main = self.loss_fn(*args, **kwargs)
        aux = moe_env.get_loss()
        moe_env.reset_loss()
        return main + self.aux_weight * aux.to(main.device, main.dtype)


class MoeCrossEntropyLoss(MoeLoss):
    """``MoeLoss(aux_weight, nn.CrossEntropyLoss, *args, **kwargs)``."""

    def __init__(self, aux_weight: float = 0.01, *args: object, **kwargs: object) -> None:
        super().__init__(aux_weight, nn.CrossEntropyLoss, *args, **kwargs)
