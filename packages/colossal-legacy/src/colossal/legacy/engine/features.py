"""The config keys ``initialize`` reads, validated into one frozen :class:`EngineFeatures`.

Known keys: ``fp16``, ``zero``, ``gradient_accumulation``, ``clip_grad_norm``,
``gradient_handler`` (``gradient_handlers`` is accepted as an alias, as one seed page writes
it), ``NUM_MICRO_BATCHES``, ``TENSOR_SHAPE``, ``model`` (its ``num_chunks``), ``torch_ddp``,
``cudnn_benchmark`` and ``cudnn_deterministic``. A known key with a bad value raises a
``ValueError`` naming the key; every other key is the user's and is left alone.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from colossal.legacy.amp.amp_type import AMP_TYPE
from colossal.legacy.amp.convert import check_amp_config
from colossal.zero import LowLevelZeroOptimizer

__all__ = ["EngineFeatures", "ZERO_KEYS", "ZeroSettings", "parse_features"]

_ZERO_SET_BY_INITIALIZE = {
    "self",
    "optimizer",
    "dp_process_group",
    "tp_process_group",
    "pp_process_group",
    "scaler_config",
    "clip_grad_norm",  # the top-level clip_grad_norm applies
}
#: LowLevelZeroOptimizer's settings a config's ``zero=dict(...)`` may give.
ZERO_OPTIMIZER_KEYS = tuple(
    name
    for name in inspect.signature(LowLevelZeroOptimizer.__init__).parameters
    if name not in _ZERO_SET_BY_INITIALIZE
)
#: Every key ``zero=dict(...)`` accepts.
ZERO_KEYS = ("stage", "level", "optimizer_config", "model_config", *ZERO_OPTIMIZER_KEYS)


@dataclass(frozen=True)
class ZeroSettings:
    """``zero=dict(...)``: the ZeRO stage and LowLevelZeroOptimizer's other settings."""

    stage: int = 1
    optimizer_kwargs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineFeatures:
    """What the config asks ``initialize`` for (see :func:`parse_features`)."""

    amp_mode: AMP_TYPE | None = None
    amp_config: Mapping[str, Any] = field(default_factory=dict)
    zero: ZeroSettings | None = None
    gradient_accumulation: int = 1
    clip_grad_norm: float = 0.0
    gradient_handlers: tuple[Mapping[str, Any], ...] | None = None
    num_microbatches: int | None = None
    num_chunks: int = 1
    tensor_shape: tuple[int, ...] | None = None
    torch_ddp: Mapping[str, Any] = field(default_factory=dict)
    cudnn_benchmark: bool | None = None
    cudnn_deterministic: bool | None = None


def _positive_int(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key}={value!r} in the config must be an int >= 1")
    return value


def _mapping(key: str, value: object) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{key} in the config must be a dict, got {type(value).__name__}")
    return value


def _bool(key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{key}={value!r} in the config must be True or False")
    return value


def _amp(value: object) -> tuple[AMP_TYPE | None, dict[str, Any]]:
    if value is None:
        return None, {}
    cfg = dict(_mapping("fp16", value))
    if "mode" not in cfg:
        raise ValueError(
            "fp16 in the config needs a mode: fp16=dict(mode=AMP_TYPE.TORCH) or "
            "fp16=dict(mode=AMP_TYPE.NAIVE)"
        )
    mode = cfg.pop("mode")
    if mode is None:
        return None, {}
    try:
        return check_amp_config(mode, cfg), cfg
    except ValueError as err:
        raise ValueError(f"fp16: {err}") from None


def _zero(value: object) -> ZeroSettings:
    cfg = dict(_mapping("zero", value))
    unknown = sorted(set(cfg) - set(ZERO_KEYS))
    if unknown:
        raise ValueError(
            f"zero=dict(...) does not take {unknown}; it takes {list(ZERO_KEYS)} (the top-level "
            "clip_grad_norm clips under ZeRO too)"
        )
    if cfg.pop("model_config", None):
        raise ValueError(
            "zero=dict(model_config=...) configures ColossalAI's ZeRO-3 sharded model, which "
            "initialize does not build; use zero=dict(stage=1 or 2) here, or "
            "colossal.legacy.zero.zero_model_wrapper(model, zero_stage=3) and "
            "zero_optim_wrapper for ZeRO-3 (Gemini)"
        )
    nested = cfg.pop("optimizer_config", None) or {}
    nested = dict(_mapping("zero.optimizer_config", nested))
    bad = sorted(set(nested) - set(ZERO_OPTIMIZER_KEYS))
    if bad:
        raise ValueError(
            f"zero=dict(optimizer_config=...) does not take {bad}; it takes "
            f"{list(ZERO_OPTIMIZER_KEYS)}"
        )
    stage, level = cfg.pop("stage", None), cfg.pop("level", None)
    if stage is not None and level is not None and stage != level:
        raise ValueError(f"zero has stage={stage!r} and level={level!r}; give one of them")
    chosen = stage if stage is not None else level
    partition = cfg.pop("partition_grad", nested.pop("partition_grad", None))
    if chosen is None:
        chosen = 2 if partition else 1
    if chosen not in (1, 2):
        raise ValueError(
            f"zero stage {chosen!r} is not supported by initialize: use stage=1 (optimizer "
            "states sharded) or stage=2 (and gradients); for ZeRO-3 use "
            "colossal.legacy.zero.zero_model_wrapper(model, zero_stage=3)"
        )
    if partition is not None and bool(partition) != (chosen == 2):
        raise ValueError(
            f"zero has stage={chosen} but partition_grad={partition!r}; partition_grad is "
            "stage 2 (drop it and give the stage)"
        )
    return ZeroSettings(chosen, {**nested, **cfg})


def _handlers(key: str, value: object) -> tuple[Mapping[str, Any], ...]:
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise ValueError(
            f"{key} in the config must be a list of dicts, e.g. "
            "[dict(type='DataParallelGradientHandler')]"
        )
    specs = []
    for spec in value:
        if not isinstance(spec, Mapping) or not isinstance(spec.get("type"), str):
            raise ValueError(f"{key} entry {spec!r} must be a dict with a 'type' (a class name)")
        specs.append(spec)
    return tuple(specs)


def parse_features(config: Mapping[str, object], pipeline_size: int = 1) -> EngineFeatures:
    """Validate the keys ``initialize`` reads from ``config``.

    Args:
        config: The job's config (``gpc.config``).
        pipeline_size: The pipeline size (``NUM_MICRO_BATCHES`` is required above 1).

    Raises:
        ValueError: A known key with a bad value (the message names it), ``fp16`` together
            with ``zero``, or ``fp16`` in torch mode under a pipeline.
    """
    amp_mode, amp_config = _amp(config.get("fp16"))
    zero = _zero(config["zero"]) if config.get("zero") is not None else None
    if zero is not None and amp_mode is not None:
        raise ValueError(
            "the config sets both fp16 and zero; ZeRO's precision follows the model's dtype "
            "(cast the model with model.half() for fp16, with ZeRO's own loss scaler set in "
            "zero=dict(initial_scale=...)), so drop fp16"
        )
    if amp_mode is AMP_TYPE.TORCH and pipeline_size > 1:
        raise ValueError(
            "fp16=dict(mode=AMP_TYPE.TORCH) does not support pipeline parallelism; use "
            "fp16=dict(mode=AMP_TYPE.NAIVE) with a pipeline"
        )
    accumulation = _positive_int("gradient_accumulation", config.get("gradient_accumulation", 1))
    clip = config.get("clip_grad_norm", 0.0)
    if isinstance(clip, bool) or not isinstance(clip, int | float) or not clip >= 0:
        raise ValueError(f"clip_grad_norm={clip!r} in the config must be a number >= 0 (0: off)")
    handlers = None
    if config.get("gradient_handler") is not None and config.get("gradient_handlers") is not None:
        raise ValueError("the config sets gradient_handler and gradient_handlers; keep one")
    for key in ("gradient_handler", "gradient_handlers"):
        if config.get(key) is not None:
            handlers = _handlers(key, config[key])
    microbatches = config.get("NUM_MICRO_BATCHES")
    if microbatches is not None:
        microbatches = _positive_int("NUM_MICRO_BATCHES", microbatches)
    elif pipeline_size > 1:
        raise ValueError(
            f"the config has pipeline={pipeline_size} but no NUM_MICRO_BATCHES; add "
            "NUM_MICRO_BATCHES = <microbatches per batch>"
        )
    chunks = 1
    model_cfg = config.get("model")
    if isinstance(model_cfg, Mapping) and model_cfg.get("num_chunks") is not None:
        chunks = _positive_int("model.num_chunks", model_cfg["num_chunks"])
    shape = config.get("TENSOR_SHAPE")
    if shape is not None:
        if not isinstance(shape, Sequence) or not all(isinstance(s, int) for s in shape):
            raise ValueError(f"TENSOR_SHAPE={shape!r} in the config must be a tuple of ints")
        shape = tuple(shape)
    ddp = dict(_mapping("torch_ddp", config.get("torch_ddp") or {}))
    bench, determ = config.get("cudnn_benchmark"), config.get("cudnn_deterministic")
    return EngineFeatures(
        amp_mode=amp_mode,
        amp_config=amp_config,
        zero=zero,
        gradient_accumulation=accumulation,
        clip_grad_norm=float(clip),
        gradient_handlers=handlers,
        num_microbatches=microbatches,
        num_chunks=chunks,
        tensor_shape=shape,
        torch_ddp=ddp,
        cudnn_benchmark=None if bench is None else _bool("cudnn_benchmark", bench),
        cudnn_deterministic=None if determ is None else _bool("cudnn_deterministic", determ),
    )
