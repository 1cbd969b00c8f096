"""``zero_model_wrapper`` / ``zero_optim_wrapper``: the seeds' one-call ZeRO.

Stage 1 and 2 shard the optimizer (and gradients) with colossal-zero's
``LowLevelZeroOptimizer``: the model is returned unchanged and remembers its stage. Stage 3
wraps the model in Gemini (chunked ZeRO-3) and the optimizer in ``GeminiOptimizer``.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.optim import Optimizer

from colossal.gemini import GeminiDDP as _GeminiDDP
from colossal.gemini import GeminiOptimizer
from colossal.legacy.zero.gemini import GeminiDDP
from colossal.zero import LowLevelZeroOptimizer

__all__ = ["ZERO_STAGE_ATTR", "zero_model_wrapper", "zero_optim_wrapper"]

#: Attribute recording the stage chosen by :func:`zero_model_wrapper` (ColossalAI's name).
ZERO_STAGE_ATTR = "_colo_zero_stage"


def zero_model_wrapper(
    model: nn.Module,
    zero_stage: int = 1,
    gemini_config: Mapping[str, object] | None = None,
    verbose: bool = False,
) -> nn.Module:
    """Prepare ``model`` for ZeRO stage 1, 2 (returned as is) or 3 (wrapped in Gemini).

    Args:
        model: The model.
        zero_stage: 1 (optimizer states sharded), 2 (and gradients) or 3 (and parameters).
        gemini_config: Stage 3's :class:`~colossal.legacy.zero.GeminiDDP` arguments
            (``placement_policy``, ``pin_memory``, ``hidden_dim``, ``search_range_mb``...).
        verbose: Log the chunk layout (stage 3).

    Raises:
        ValueError: A stage other than 1, 2, 3, or ``gemini_config`` below stage 3.
    """
    if zero_stage not in (1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage!r} must be 1, 2 or 3")
    if zero_stage != 3:
        if gemini_config:
            raise ValueError(
                f"gemini_config applies to zero_stage=3 only (got zero_stage={zero_stage})"
            )
        setattr(model, ZERO_STAGE_ATTR, zero_stage)
        return model
    config = {"device": None, **dict(gemini_config or {})}
    config.setdefault("verbose", verbose)
    wrapped = GeminiDDP(model, **config)  # type: ignore[arg-type]
    setattr(wrapped, ZERO_STAGE_ATTR, 3)
    return wrapped


def zero_optim_wrapper(
    model: nn.Module,
    optimizer: Optimizer,
    initial_scale: float = 2**16,
    growth_factor: float = 2,
    backoff_factor: float = 0.5,
    growth_interval: int = 1000,
    hysteresis: int = 2,
    min_scale: float = 1,
    max_scale: float = 2**32,
    clip_grad_norm: float = 0.0,
    norm_type: float = 2.0,
    verbose: bool = False,
    optim_config: Mapping[str, object] | None = None,
) -> LowLevelZeroOptimizer | GeminiOptimizer:
    """Wrap ``optimizer`` for the stage :func:`zero_model_wrapper` chose.

    Args:
        model: The model returned by :func:`zero_model_wrapper`.
        optimizer: Its optimizer.
        initial_scale: The fp16 loss scaler's first scale.
        growth_factor: Scale growth after ``growth_interval`` steps without overflow.
        backoff_factor: Scale reduction on overflow.
        growth_interval: Steps without overflow before the scale grows.
        hysteresis: Overflows tolerated before the scale backs off.
        min_scale: Lowest scale.
        max_scale: Highest scale.
        clip_grad_norm: Clip gradients to this norm (0: off).
        norm_type: Norm of the clipping.
        verbose: Log more.
        optim_config: Further ``LowLevelZeroOptimizer`` (stage 1/2) or ``GeminiOptimizer``
            (stage 3) arguments.

    Raises:
        ValueError: ``model`` did not go through :func:`zero_model_wrapper`.
    """
    stage = getattr(model, ZERO_STAGE_ATTR, None)
    if stage is None and isinstance(model, _GeminiDDP):
        stage = 3
    if stage not in (1, 2, 3):
        raise ValueError(
            "zero_optim_wrapper needs the model returned by zero_model_wrapper(model, "
            "zero_stage=...); wrap the model first"
        )
    scaler = {
        "initial_scale": initial_scale,
        "growth_factor": growth_factor,
        "backoff_factor": backoff_factor,
        "growth_interval": growth_interval,
        "hysteresis": hysteresis,
        "min_scale": min_scale,
        "max_scale": max_scale,
        "norm_type": norm_type,
        "verbose": verbose,
    }
    extra = dict(optim_config or {})
    if stage == 3:
        assert isinstance(model, _GeminiDDP)
        return GeminiOptimizer(optimizer, model, max_norm=clip_grad_norm, **scaler, **extra)  # type: ignore[arg-type]
    return LowLevelZeroOptimizer(
        optimizer,
        partition_grad=stage == 2,
        clip_grad_norm=clip_grad_norm,
        **scaler,  # type: ignore[arg-type]
        **extra,  # type: ignore[arg-type]
    )
