"""Booster-level mixed precision for plugins that do not control precision (e.g. DDP).

The forward runs under ``torch.autocast`` in fp16 or bf16 while parameters, gradients and
optimizer states stay fp32; fp16 adds a dynamic loss scaler whose overflow verdict is agreed
across all ranks (``colossal.core.precision``). ColossalAI's documented names
(``FP16TorchMixedPrecision``, ``FP16NaiveMixedPrecision``, ``BF16MixedPrecision``) map onto it;
apex and fp8 are refused with the supported list.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from colossal.core import (
    DynamicGradScaler,
    ModelWrapper,
    OptimizerWrapper,
    ScalerConfig,
    clip_grad_norm_,
    grad_norm,
    parse_precision,
)
from colossal.core.precision import (
    Precision,
    agree_overflow,
    local_overflow,
    scaler_config_from,
)

if TYPE_CHECKING:
    from colossal.booster.plugin.base import Criterion

logger = logging.getLogger(__name__)

__all__ = [
    "AutocastModel",
    "BF16MixedPrecision",
    "FP8MixedPrecision",
    "FP16ApexMixedPrecision",
    "FP16NaiveMixedPrecision",
    "FP16TorchMixedPrecision",
    "MixedPrecision",
    "MixedPrecisionOptimizer",
    "mixed_precision_factory",
]


_SCALER_FIELDS = tuple(f.name for f in dataclasses.fields(ScalerConfig))


@dataclasses.dataclass(frozen=True, init=False)
class MixedPrecision:
    """Autocast + (for fp16) dynamic loss scaling, applied by the Booster.

    The loss scaler's settings are kept as one :class:`~colossal.core.ScalerConfig`
    (``scaler_config``); the keyword settings build it.

    Args:
        precision: ``"fp16"`` or ``"bf16"``.
        initial_scale: fp16 scaler: initial loss scale.
        min_scale: fp16 scaler: smallest scale.
        growth_factor: fp16 scaler: growth multiplier.
        backoff_factor: fp16 scaler: backoff multiplier.
        growth_interval: fp16 scaler: clean steps between growths.
        hysteresis: fp16 scaler: overflow steps before a backoff.
        max_scale: fp16 scaler: largest scale.
        scaler_config: The scaler settings whole, instead of the seven keywords above.

    Raises:
        ValueError: ``precision`` is not fp16/bf16, or invalid scaler settings.
        TypeError: ``scaler_config`` together with changed keyword settings.
    """

    precision: str
    scaler_config: ScalerConfig

    def __init__(
        self,
        precision: str = "fp16",
        initial_scale: float = 2**16,
        min_scale: float = 1.0,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        max_scale: float = 2**32,
        *,
        scaler_config: ScalerConfig | None = None,
    ) -> None:
        parsed = parse_precision(precision)
        if parsed is Precision.FP32:
            raise ValueError(
                "MixedPrecision needs 'fp16' or 'bf16', got 'fp32'; pass mixed_precision=None "
                "to train in fp32"
            )
        config = scaler_config_from(
            {
                "initial_scale": initial_scale,
                "min_scale": min_scale,
                "growth_factor": growth_factor,
                "backoff_factor": backoff_factor,
                "growth_interval": growth_interval,
                "hysteresis": hysteresis,
                "max_scale": max_scale,
            },
            scaler_config,
            owner=type(self).__name__,
        )
        object.__setattr__(self, "precision", parsed.value)
        object.__setattr__(self, "scaler_config", config)

    def __getattr__(self, name: str) -> float:
        # The scaler settings read as before (``mp.initial_scale``), from the one config.
        if name in _SCALER_FIELDS:
            value: float = getattr(object.__getattribute__(self, "scaler_config"), name)
            return value
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def dtype(self) -> torch.dtype:
        """The autocast dtype."""
        return parse_precision(self.precision).dtype

    def make_scaler(self) -> DynamicGradScaler | None:
        """A fresh loss scaler for fp16, None for bf16."""
        if self.precision != "fp16":
            return None
        return DynamicGradScaler(self.scaler_config)

    def configure(
        self,
        model: nn.Module,
        optimizer: Optimizer | OptimizerWrapper | None = None,
        criterion: Criterion | None = None,
    ) -> tuple[AutocastModel, MixedPrecisionOptimizer | None, Criterion | None]:
        """Wrap the model in autocast and the optimizer in a (scaling) mixed-precision one."""
        autocast = AutocastModel(model, self.dtype)
        if optimizer is None:
            return autocast, None, criterion
        inner = optimizer.unwrap() if isinstance(optimizer, OptimizerWrapper) else optimizer
        wrapped = MixedPrecisionOptimizer(inner, self.make_scaler())
        if isinstance(optimizer, OptimizerWrapper) and optimizer.param_names is not None:
            wrapped.set_param_names(optimizer.param_names)
        return autocast, wrapped, criterion


SUPPORTED_MIXED_PRECISION = (
    "'fp16' (torch autocast + dynamic loss scaler), 'fp16_naive' (the same), 'bf16', "
    "'fp32' or None (no mixed precision), or an object of MixedPrecision, "
    "FP16TorchMixedPrecision, FP16NaiveMixedPrecision or BF16MixedPrecision"
)


class FP16TorchMixedPrecision(MixedPrecision):
    """ColossalAI's torch-AMP fp16: autocast in fp16 with a dynamic loss scaler.

    Arguments and defaults are ColossalAI's (those of ``torch.amp.GradScaler``). As with
    GradScaler, the scale backs off at every overflow step (``hysteresis=1``); it stays
    within ``[min(1, init_scale), max(2**32, init_scale)]``.

    Args:
        init_scale: Initial loss scale.
        growth_factor: Multiplier after ``growth_interval`` clean steps (> 1).
        backoff_factor: Multiplier at an overflow step (in (0, 1)).
        growth_interval: Clean steps between growths.

    Example:
        >>> mp = FP16TorchMixedPrecision(init_scale=2.0**16, growth_interval=2000)
        >>> booster = Booster(mixed_precision=mp, plugin=TorchDDPPlugin())
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        numeric = isinstance(init_scale, int | float) and not isinstance(init_scale, bool)
        config = ScalerConfig(
            initial_scale=init_scale,
            min_scale=min(1.0, init_scale) if numeric else 1.0,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            hysteresis=1,
            max_scale=max(2.0**32, init_scale) if numeric else 2.0**32,
        )
        super().__init__("fp16", scaler_config=config)


class FP16NaiveMixedPrecision(MixedPrecision):
    """ColossalAI's naive fp16 AMP, run as torch autocast fp16 with a dynamic loss scaler.

    ColossalAI casts the whole model to fp16 and keeps fp32 masters; here the weights stay
    fp32 and the forward runs under fp16 autocast (at least as accurate). The scaler takes
    this class's ColossalAI defaults (``initial_scale=2**32``).

    Args:
        log_num_zeros_in_grad: Not supported (ignored with a warning when True).
        initial_scale: Initial loss scale.
        growth_factor: Multiplier after 1000 clean steps.
        backoff_factor: Multiplier on overflow.
        hysteresis: Overflow steps tolerated before a backoff.
        max_scale: Largest scale.
        verbose: Ignored (overflows are logged at INFO by ``colossal.core.precision``).
    """

    def __init__(
        self,
        log_num_zeros_in_grad: bool = False,
        initial_scale: float = 2**32,
        growth_factor: float = 2,
        backoff_factor: float = 0.5,
        hysteresis: int = 2,
        max_scale: float = 2**32,
        verbose: bool = False,
    ) -> None:
        if log_num_zeros_in_grad:
            logger.warning("FP16NaiveMixedPrecision: log_num_zeros_in_grad is not supported")
        config = ScalerConfig(
            initial_scale=initial_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            hysteresis=hysteresis,
            max_scale=max_scale,
        )
        super().__init__("fp16", scaler_config=config)


class BF16MixedPrecision(MixedPrecision):
    """ColossalAI's bf16 mixed precision: autocast in bf16 (no loss scaling)."""

    def __init__(self) -> None:
        super().__init__("bf16")


class FP16ApexMixedPrecision:
    """ColossalAI's apex AMP: not available (Colossal does not depend on apex).

    Raises:
        ValueError: Always, naming the supported mixed precisions.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise ValueError(
            "FP16ApexMixedPrecision (apex AMP) is not supported; use FP16TorchMixedPrecision(...) "
            f"(apex O1 = autocast + dynamic loss scaling). Supported: {SUPPORTED_MIXED_PRECISION}"
        )


class FP8MixedPrecision:
    """ColossalAI's fp8 mixed precision: not available.

    Raises:
        ValueError: Always, naming the supported mixed precisions.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise ValueError(
            f"FP8MixedPrecision is not supported; supported: {SUPPORTED_MIXED_PRECISION}"
        )


_BY_NAME: dict[str, Callable[[], MixedPrecision]] = {
    "fp16": lambda: MixedPrecision("fp16"),
    "fp16_naive": FP16NaiveMixedPrecision,
    "bf16": lambda: MixedPrecision("bf16"),
}


def mixed_precision_factory(name: str) -> MixedPrecision | None:
    """The mixed precision named ``name`` as ``Booster(mixed_precision=name)`` reads it.

    ``"fp16"`` and ``"bf16"`` are :class:`MixedPrecision` with default settings,
    ``"fp16_naive"`` is :class:`FP16NaiveMixedPrecision`, ``"fp32"`` is None.

    Raises:
        ValueError: Any other name (``"fp16_apex"``, ``"fp8"``, ...), listing the supported
            values.
    """
    key = name.lower()
    if key == "fp32":
        return None
    if key not in _BY_NAME:
        raise ValueError(
            f"mixed_precision={name!r} is not supported; supported: {SUPPORTED_MIXED_PRECISION}"
        )
    return _BY_NAME[key]()


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
        return self._scaled_norm(norm_type) / self.loss_scale

    def clip_grad_by_norm(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip the unscaled gradients to ``max_norm`` during the next :meth:`step`."""
        if max_norm <= 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm}")
        self._pending_clip = (float(max_norm), float(norm_type))
        return self._scaled_norm(norm_type) / self.loss_scale

    def _scaled_norm(self, norm_type: float) -> float:
        """The global norm of the gradients as they are (still carrying the loss scale)."""
        return float(grad_norm(list(self._params()), norm_type))

    def step(self, *args: Any, **kwargs: Any) -> float | None:
        """Unscale, check overflow on every rank, clip if asked, and step (or skip).

        Returns:
            What the optimizer's ``step`` returns (the closure's loss, if one is given);
            None for a skipped step.
        """
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
            self._grad_norm = float(clip_grad_norm_(list(self._params()), max_norm, norm_type))
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
