"""Booster-level mixed precision for plugins that do not control precision (e.g. DDP).

The forward runs under ``torch.autocast`` in fp16 or bf16 while parameters, gradients and
optimizer states stay fp32; fp16 adds a dynamic loss scaler whose overflow verdict is agreed
across all ranks (``colossal.core.precision``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from colossal.core import DynamicGradScaler, ModelWrapper, OptimizerWrapper, parse_precision
from colossal.core.precision import Precision, agree_overflow, local_overflow

logger = logging.getLogger(__name__)

__all__ = ["AutocastModel", "MixedPrecision", "MixedPrecisionOptimizer"]


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """Autocast + (for fp16) dynamic loss scaling, applied by the Booster.

    Args:
        precision: ``"fp16"`` or ``"bf16"``.
        initial_scale: fp16 scaler: initial loss scale.
        min_scale: fp16 scaler: smallest scale.
        growth_factor: fp16 scaler: growth multiplier.
        backoff_factor: fp16 scaler: backoff multiplier.
        growth_interval: fp16 scaler: clean steps between growths.
        hysteresis: fp16 scaler: overflow steps before a backoff.
        max_scale: fp16 scaler: largest scale.

    Raises:
        ValueError: ``precision`` is not fp16/bf16.
    """

    precision: str = "fp16"
    initial_scale: float = 2**16
    min_scale: float = 1.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2
    max_scale: float = 2**32

    def __post_init__(self) -> None:
        parsed = parse_precision(self.precision)
        if parsed is Precision.FP32:
            raise ValueError(
                "MixedPrecision needs 'fp16' or 'bf16', got 'fp32'; pass mixed_precision=None "
                "to train in fp32"
            )
        object.__setattr__(self, "precision", parsed.value)

    @property
    def dtype(self) -> torch.dtype:
        """The autocast dtype."""
        return parse_precision(self.precision).dtype

    def make_scaler(self) -> DynamicGradScaler | None:
        """A fresh loss scaler for fp16, None for bf16."""
        if self.precision != "fp16":
            return None
        return DynamicGradScaler(
            self.initial_scale,
            self.min_scale,
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
            self.hysteresis,
            self.max_scale,
        )

    def configure(
        self,
        model: nn.Module,
        optimizer: Any = None,
        criterion: Callable[..., Any] | None = None,
    ) -> tuple[nn.Module, Any, Callable[..., Any] | None]:
        """Wrap the model in autocast and the optimizer in a (scaling) mixed-precision one."""
        model = AutocastModel(model, self.dtype)
        if optimizer is not None:
            inner = optimizer.unwrap() if isinstance(optimizer, OptimizerWrapper) else optimizer
            wrapped = MixedPrecisionOptimizer(inner, self.make_scaler())
            for attr in ("colossal_param_names",):
                if hasattr(optimizer, attr):
                    setattr(wrapped, attr, getattr(optimizer, attr))
            optimizer = wrapped
        return model, optimizer, criterion


class AutocastModel(ModelWrapper):
    """Runs the wrapped module's forward under ``torch.autocast``.

    Args:
        module: The module (possibly already wrapped, e.g. by DDP).
        dtype: Autocast dtype (fp16 or bf16).
    """

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        super().__init__(module)
        self.dtype = dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Call the module under autocast on the device type of its parameters."""
        param = next(self.module.parameters(), None)
        device_type = param.device.type if param is not None else "cpu"
        with torch.autocast(device_type=device_type, dtype=self.dtype):
            return self.module(*args, **kwargs)


class MixedPrecisionOptimizer(OptimizerWrapper):
    """An fp32 optimizer with a loss scaler: skips overflow steps, unscales gradients.

    Args:
        optim: The optimizer over the fp32 parameters.
        scaler: The loss scaler (None: bf16, no scaling).
        group: The group that agrees on overflow (the whole job when None).
    """

    def __init__(
        self,
        optim: Optimizer,
        scaler: DynamicGradScaler | None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(optim)
        self.scaler = scaler
        self.group = group
        self._pending_clip: tuple[float, float] | None = None
        self._grad_norm: float | None = None

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without scaling)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Back-propagate the scaled loss."""
        if self.scaler is not None:
            loss = self.scaler.scale_loss(loss)
        loss.backward(*args, **kwargs)

    def backward_by_grad(
        self, tensor: torch.Tensor, grad: torch.Tensor, *args: Any, **kwargs: Any
    ) -> None:
        """Back-propagate ``grad`` from ``tensor``.

        Under fp16, ``grad`` must already carry the loss scale (it is the gradient of the
        scaled loss, as a pipeline stage receives it from the next stage); it is not scaled
        again. Outside a pipeline, take it from ``loss * optimizer.loss_scale``.
        """
        torch.autograd.backward(tensor, grad, *args, **kwargs)

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self._params() if p.grad is not None]

    def get_grad_norm(self, norm_type: float = 2.0) -> float:
        """Norm of the unscaled gradients (the last step's, after :meth:`step`)."""
        if self._grad_norm is not None:
            return self._grad_norm
        return super().get_grad_norm(norm_type) / self.loss_scale

    def clip_grad_by_norm(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip the unscaled gradients to ``max_norm`` during the next :meth:`step`."""
        if max_norm <= 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm}")
        self._pending_clip = (float(max_norm), float(norm_type))
        return super().get_grad_norm(norm_type) / self.loss_scale

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """Unscale, check overflow on every rank, clip if asked, and step (or skip)."""
        grads = self._grads()
        if self.scaler is not None:
            scale = self.scaler.scale
            overflow = local_overflow(grads)
            if dist.is_initialized():
                overflow = agree_overflow(overflow, self.group)
            self.scaler.update(overflow)
            if overflow:
                logger.info("gradient overflow: step skipped, loss scale %g", self.scaler.scale)
                self._pending_clip = None
                self.zero_grad()
                return None
            for g in grads:
                g.mul_(1.0 / scale)
        if self._pending_clip is not None:
            max_norm, norm_type = self._pending_clip
            params = [p for p in self._params() if p.grad is not None]
            self._grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type))
            self._pending_clip = None
        return self.optim.step(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state dict plus the loss scaler's state."""
        state = self.optim.state_dict()
        state["loss_scaler"] = self.scaler.state_dict() if self.scaler is not None else None
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the optimizer's and the loss scaler's state."""
        state_dict = dict(state_dict)
        scaler_state = state_dict.pop("loss_scaler", None)
        self.optim.load_state_dict(state_dict)
        if scaler_state is not None and self.scaler is not None:
            self.scaler.load_state_dict(scaler_state)
