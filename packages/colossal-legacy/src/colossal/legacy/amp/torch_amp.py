"""AMP_TYPE.TORCH: the forward under fp16 autocast, fp32 weights, a dynamic loss scaler.

Built from the meta-package's Booster pieces (:class:`~colossal.booster.
AutocastModel` and :class:`~colossal.booster.MixedPrecisionOptimizer`) with the
seeds' ``torch.cuda.amp.GradScaler`` arguments. The scaler's overflow verdict is agreed across
every rank, so the mode also works with tensor and pipeline parallelism.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from colossal.booster import (
    AutocastModel,
    FP16TorchMixedPrecision,
    MixedPrecisionOptimizer,
)
from colossal.core import get_accelerator

__all__ = ["TorchAMPLoss", "TorchAMPModel", "TorchAMPOptimizer", "convert_to_torch_amp"]


class TorchAMPModel(AutocastModel):
    """Runs the model's forward under ``torch.autocast(dtype=torch.float16)``.

    Args:
        model: The model (its weights stay fp32).
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model, torch.float16)


class TorchAMPOptimizer(MixedPrecisionOptimizer):
    """An fp32 optimizer with torch's dynamic loss scaling (ColossalAI's arguments).

    ``backward`` scales the loss; ``step`` unscales the gradients, skips the step on every
    rank when any rank found an inf/NaN (and backs the scale off), clips if asked, and
    steps. As with ``GradScaler`` the scale backs off at every overflow step.

    Args:
        optim: The optimizer over the model's fp32 parameters.
        init_scale: Initial loss scale.
        growth_factor: Multiplier after ``growth_interval`` steps without overflow.
        backoff_factor: Multiplier at an overflow step.
        growth_interval: Steps without overflow between growths.
        enabled: False disables loss scaling (the forward still runs under autocast).
        group: The ranks that agree on overflow (every rank when None).
    """

    def __init__(
        self,
        optim: Optimizer,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        mp = FP16TorchMixedPrecision(init_scale, growth_factor, backoff_factor, growth_interval)
        super().__init__(optim, mp.make_scaler() if enabled else None, group)


class TorchAMPLoss(nn.Module):
    """Computes the loss under fp16 autocast (autocast keeps losses in fp32).

    Args:
        loss: The criterion.
    """

    def __init__(self, loss: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.loss = loss

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``loss(*args, **kwargs)`` under autocast on the accelerator's device type."""
        device_type = get_accelerator().get_current_device().type
        with torch.autocast(device_type=device_type, dtype=torch.float16):
            return self.loss(*args, **kwargs)


def convert_to_torch_amp(
    model: nn.Module,
    optimizer: Optimizer,
    criterion: Callable[..., torch.Tensor] | None = None,
    amp_config: Mapping[str, object] | None = None,
) -> tuple[TorchAMPModel, TorchAMPOptimizer, TorchAMPLoss | None]:
    """Wrap model, optimizer and criterion for :attr:`AMP_TYPE.TORCH`.

    Args:
        model: The model.
        optimizer: Its torch optimizer.
        criterion: The loss function, or None.
        amp_config: :class:`TorchAMPOptimizer`'s keyword arguments (``init_scale``...).
    """
    # The settings' types are the optimizer's to check: they come from a config file.
    config: dict[str, Any] = dict(amp_config or {})
    return (
        TorchAMPModel(model),
        TorchAMPOptimizer(optimizer, **config),
        TorchAMPLoss(criterion) if criterion is not None else None,
    )
