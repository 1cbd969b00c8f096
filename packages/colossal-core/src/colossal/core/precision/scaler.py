"""Dynamic loss scaling for fp16 training, with an overflow verdict agreed across ranks."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from colossal.core.accelerator import get_accelerator
from colossal.core.comm import all_reduce

logger = logging.getLogger(__name__)

Groups = ProcessGroup | Sequence[ProcessGroup | None] | None


_FLOAT_FIELDS = ("initial_scale", "min_scale", "growth_factor", "backoff_factor", "max_scale")


@dataclass(frozen=True)
class ScalerConfig:
    """The loss scaler's settings, validated: the one place that lists them.

    Constructors that expose these settings as keyword arguments (the documented ColossalAI
    ones) build one ``ScalerConfig`` from them and pass it on whole.

    Args:
        initial_scale: Starting loss scale.
        min_scale: Lower bound of the scale (> 0).
        growth_factor: Multiplier applied after ``growth_interval`` clean steps (> 1).
        backoff_factor: Multiplier applied on overflow (in (0, 1)).
        growth_interval: Clean steps between growths (int >= 1).
        hysteresis: Overflow steps tolerated before backing off (int >= 1).
        max_scale: Upper bound of the scale.

    Raises:
        ValueError: Settings out of range (every problem is named at once).
    """

    initial_scale: float = 2**16
    min_scale: float = 1.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2
    max_scale: float = 2**32

    def __post_init__(self) -> None:
        problems = []
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                problems.append(f"{name}={value!r} must be a number")
            else:
                object.__setattr__(self, name, float(value))
        if problems:
            raise ValueError("invalid loss scaler settings: " + "; ".join(problems))
        if not self.min_scale > 0:
            problems.append(f"min_scale={self.min_scale} must be > 0")
        if not self.min_scale <= self.initial_scale <= self.max_scale:
            problems.append(
                f"initial_scale={self.initial_scale} must lie in [min_scale={self.min_scale}, "
                f"max_scale={self.max_scale}]"
            )
        if not self.growth_factor > 1:
            problems.append(f"growth_factor={self.growth_factor} must be > 1")
        if not 0 < self.backoff_factor < 1:
            problems.append(f"backoff_factor={self.backoff_factor} must be in (0, 1)")
        if not (isinstance(self.growth_interval, int) and self.growth_interval >= 1):
            problems.append(f"growth_interval={self.growth_interval} must be an int >= 1")
        if not (isinstance(self.hysteresis, int) and self.hysteresis >= 1):
            problems.append(f"hysteresis={self.hysteresis} must be an int >= 1")
        if problems:
            raise ValueError("invalid loss scaler settings: " + "; ".join(problems))


def scaler_config_from(
    settings: Mapping[str, object],
    config: ScalerConfig | None = None,
    *,
    defaults: Mapping[str, object] | None = None,
    owner: str = "this constructor",
) -> ScalerConfig:
    """The one :class:`ScalerConfig` of a constructor given keyword settings or a config.

    For constructors that expose the settings as documented keyword arguments and also
    accept ``scaler_config=``: ``config`` is returned as it is; without it the settings are
    validated into a new config.

    Args:
        settings: The constructor's keyword settings (field name -> value).
        config: A config passed whole (``scaler_config=``), if any.
        defaults: The constructor's defaults where they differ from :class:`ScalerConfig`'s.
        owner: Name used in errors.

    Raises:
        TypeError: ``config`` is not a ScalerConfig, or is given together with settings
            that differ from their defaults.
        ValueError: Invalid settings.
    """
    if config is None:  # ScalerConfig.__post_init__ validates the values' types
        return ScalerConfig(**cast(Mapping[str, Any], settings))
    if not isinstance(config, ScalerConfig):
        raise TypeError(
            f"{owner}: scaler_config must be a ScalerConfig, got {type(config).__name__}"
        )
    base = {**asdict(ScalerConfig()), **(defaults or {})}
    changed = sorted(k for k, v in settings.items() if v != base.get(k))
    if changed:
        raise TypeError(
            f"{owner}: pass the loss scaler settings either as scaler_config=ScalerConfig(...) "
            f"or as keywords, not both (also got {changed})"
        )
    return config


def local_overflow(tensors: Iterable[torch.Tensor | None]) -> bool:
    """Whether any tensor holds an inf or NaN (on this rank only)."""
    found = None
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        bad = ~torch.isfinite(t).all()
        found = bad if found is None else found | bad
    return bool(found) if found is not None else False


def agree_overflow(overflow: bool, group: Groups = None) -> bool:
    """OR ``overflow`` over every rank of ``group`` (or of each group in a sequence).

    Every rank of the group must call this, whatever it holds, or the others wait. Without
    an initialized process group the local verdict is returned. The flag lives on the
    accelerator's current device (nccl only reduces CUDA tensors; gloo reduces CPU ones).
    """
    if not dist.is_initialized():
        return overflow
    device = get_accelerator().get_current_device()
    flag = torch.tensor([1.0 if overflow else 0.0], device=device)
    groups = group if isinstance(group, Sequence) else [group]
    for g in groups:
        all_reduce(flag, op=ReduceOp.MAX, group=g)
    return bool(flag.item() > 0)


class DynamicGradScaler:
    """Loss scale that backs off on overflow and grows after a run of clean steps.

    On an overflow step the step is skipped by the optimizer; after ``hysteresis`` overflow
    steps the scale is multiplied by ``backoff_factor`` (not below ``min_scale``). After
    ``growth_interval`` consecutive clean steps it is multiplied by ``growth_factor`` (not
    above ``max_scale``) and the hysteresis count restarts.

    Args:
        config: The settings (:class:`ScalerConfig`); defaults when ``None``.
        **settings: Instead of ``config``, any of :class:`ScalerConfig`'s fields by keyword
            (``DynamicGradScaler(initial_scale=2**10, hysteresis=1)``).

    Raises:
        ValueError: settings out of range (all problems are named at once).
        TypeError: both ``config`` and keyword settings, or an unknown setting.
    """

    def __init__(self, config: ScalerConfig | None = None, **settings: float) -> None:
        if config is not None and settings:
            raise TypeError(
                f"pass either config=ScalerConfig(...) or keyword settings, not both "
                f"(got config and {sorted(settings)})"
            )
        if config is not None and not isinstance(config, ScalerConfig):
            raise TypeError(
                f"config must be a ScalerConfig, got {type(config).__name__}; pass settings "
                "by keyword (initial_scale=...) or as ScalerConfig(...)"
            )
        unknown = sorted(set(settings) - set(ScalerConfig.__dataclass_fields__))
        if unknown:
            raise TypeError(
                f"unknown loss scaler setting(s) {unknown}; the settings are "
                f"{list(ScalerConfig.__dataclass_fields__)}"
            )
        self.config = config if config is not None else ScalerConfig(**settings)  # type: ignore[arg-type]
        self._scale = self.config.initial_scale
        self._growth_step = 0
        self._hysteresis_step = 0

    @property
    def scale(self) -> float:
        """The current loss scale."""
        return self._scale

    @property
    def inv_scale(self) -> float:
        """``1 / scale``: multiply gradients by it to unscale them."""
        return 1.0 / self._scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale``."""
        return loss * self._scale

    def check_overflow(self, grads: Iterable[torch.Tensor | None], group: Groups = None) -> bool:
        """Whether any rank of ``group`` found an inf/NaN in its ``grads`` (collective)."""
        return agree_overflow(local_overflow(grads), group)

    def update(self, overflow: bool) -> None:
        """Advance the scaler by one step whose (agreed) overflow verdict is ``overflow``."""
        cfg = self.config
        if overflow:
            self._growth_step = 0
            self._hysteresis_step += 1
            if self._hysteresis_step >= cfg.hysteresis:
                old = self._scale
                self._scale = max(self._scale * cfg.backoff_factor, cfg.min_scale)
                logger.info("loss scale backed off from %g to %g after overflow", old, self._scale)
            return
        self._growth_step += 1
        if self._growth_step >= cfg.growth_interval:
            self._growth_step = 0
            self._hysteresis_step = 0
            self._scale = min(self._scale * cfg.growth_factor, cfg.max_scale)

    def state_dict(self) -> dict[str, float]:
        """Scale, step counters and settings (plain Python numbers, JSON-friendly)."""
        return {
            "scale": self._scale,
            "growth_step": self._growth_step,
            "hysteresis_step": self._hysteresis_step,
            **asdict(self.config),
        }

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        """Restore what :meth:`state_dict` returned (settings included).

        Raises:
            KeyError: ``state`` lacks the scale.
        """
        if "scale" not in state:
            raise KeyError(f"loss scaler state needs a 'scale' entry, got keys {sorted(state)}")
        fields = {k: state[k] for k in asdict(self.config) if k in state}
        if fields:
            self.config = ScalerConfig(**{**asdict(self.config), **fields})
        self._scale = float(state["scale"])
        self._growth_step = int(state.get("growth_step", 0))
        self._hysteresis_step = int(state.get("hysteresis_step", 0))
