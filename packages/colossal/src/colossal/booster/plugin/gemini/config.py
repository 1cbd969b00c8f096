"""Validated settings of :class:`~colossal.booster.plugin.gemini.GeminiPlugin`.

One frozen dataclass per concern: :class:`GeminiConfig` holds what ``GeminiDDP`` and
``GeminiOptimizer`` receive; :class:`ShardformerOptions` the tensor-parallel size and the
Shardformer optimizations applied before Gemini wraps the model, and the size of the
replicas of Gemini's shard group (``extra_dp_size``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TypedDict

import torch

from colossal.core import ScalerConfig, parse_precision

__all__ = [
    "ChunkConfig",
    "GeminiConfig",
    "GeminiShardConfigOptions",
    "ShardformerOptions",
    "normalize_chunk_config",
]

_PLACEMENTS = ("static", "auto")
_PRECISIONS = ("fp16", "bf16", "fp32")
_CHUNK_KEYS = frozenset({"chunk_size", "keep_gathered"})
_SHARDFORMER_FLAGS = (
    "enable_all_optimization",
    "enable_fused_normalization",
    "enable_flash_attention",
    "enable_sequence_parallelism",
    "enable_jit_fused",
    "enable_sequence_overlap",
)


def _fraction(name: str, value: object, low_open: bool = False) -> float:
    """``value`` as a float in [0, 1] (or (0, 1] when ``low_open``), else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise ValueError(f"GeminiPlugin: {name}={value!r} must be a number in [0, 1]")
    low_ok = value > 0 if low_open else value >= 0
    if not (low_ok and value <= 1):
        interval = "(0, 1]" if low_open else "[0, 1]"
        raise ValueError(
            f"GeminiPlugin: {name}={value!r} is outside {interval}; it is a fraction "
            f"(e.g. {name}=1.0 for all, 0.0 for none)"
        )
    return float(value)


def _positive(name: str, value: object, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise ValueError(f"GeminiPlugin: {name}={value!r} must be a number")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"GeminiPlugin: {name}={value!r} must be {bound}")
    return float(value)


def _size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"GeminiPlugin: {name}={value!r} must be an int >= 1 (1: off)")
    return value


class GeminiShardConfigOptions(TypedDict, total=False):
    """The ``colossal.shardformer.ShardConfig`` keyword arguments of :class:`ShardformerOptions`.

    ``sequence_parallelism_mode`` is present only with sequence parallelism.
    """

    enable_all_optimization: bool
    enable_fused_normalization: bool
    enable_flash_attention: bool
    enable_sequence_parallelism: bool
    enable_jit_fused: bool
    enable_sequence_overlap: bool
    enable_tensor_parallelism: bool
    sequence_parallelism_mode: str


@dataclasses.dataclass(frozen=True)
class ShardformerOptions:
    """Tensor parallelism and the Shardformer optimizations of a :class:`GeminiPlugin`.

    Attributes:
        tp_size: Tensor-parallel size (1: none); the data-parallel size is the rest.
        extra_dp_size: Replicas of the Gemini shard group (1: none); the chunks are sharded
            over ``world / (tp_size * extra_dp_size)`` ranks.
        enable_all_optimization: Fused normalization, flash attention (Shardformer).
        enable_fused_normalization: colossal-kernels' fused LayerNorm/RMSNorm.
        enable_flash_attention: colossal-kernels' attention dispatch.
        enable_sequence_parallelism: Split the sequence over the tensor-parallel group
            (``split_gather``); needs ``tp_size > 1``.
        enable_jit_fused: Accepted (a no-op in Shardformer).
        enable_sequence_overlap: Shardformer's option (needs sequence parallelism).

    Raises:
        ValueError: A size is not an int >= 1, or a flag lacks what it needs.
    """

    tp_size: int = 1
    extra_dp_size: int = 1
    enable_all_optimization: bool = False
    enable_fused_normalization: bool = False
    enable_flash_attention: bool = False
    enable_sequence_parallelism: bool = False
    enable_jit_fused: bool = False
    enable_sequence_overlap: bool = False

    def __post_init__(self) -> None:
        _size("tp_size", self.tp_size)
        _size("extra_dp_size", self.extra_dp_size)
        for name in _SHARDFORMER_FLAGS:
            object.__setattr__(self, name, bool(getattr(self, name)))
        if self.enable_sequence_parallelism and self.tp_size == 1:
            raise ValueError(
                "GeminiPlugin(enable_sequence_parallelism=True) splits the sequence over the "
                "tensor-parallel group ('split_gather'); it needs tp_size > 1, got tp_size=1"
            )
        if self.enable_sequence_overlap and not self.enable_sequence_parallelism:
            raise ValueError(
                "GeminiPlugin(enable_sequence_overlap=True) needs "
                "enable_sequence_parallelism=True"
            )

    @property
    def uses_shardformer(self) -> bool:
        """Whether the model goes through Shardformer (tensor parallelism or a flag)."""
        return self.tp_size > 1 or any(getattr(self, n) for n in _SHARDFORMER_FLAGS)

    def shard_config_kwargs(self) -> GeminiShardConfigOptions:
        """The ``ShardConfig`` keyword arguments (the tensor-parallel group excepted)."""
        kwargs = GeminiShardConfigOptions(
            enable_all_optimization=self.enable_all_optimization,
            enable_fused_normalization=self.enable_fused_normalization,
            enable_flash_attention=self.enable_flash_attention,
            enable_sequence_parallelism=self.enable_sequence_parallelism,
            enable_jit_fused=self.enable_jit_fused,
            enable_sequence_overlap=self.enable_sequence_overlap,
            enable_tensor_parallelism=self.tp_size > 1,
        )
        if self.enable_sequence_parallelism:
            kwargs["sequence_parallelism_mode"] = "split_gather"
        return kwargs


class ChunkConfig(TypedDict):
    """A normalized ``chunk_config_dict`` (see :func:`normalize_chunk_config`)."""

    chunk_size: int
    keep_gathered: bool


def normalize_chunk_config(config: object, dp_size: int) -> ChunkConfig | None:
    """``{"chunk_size": int, "keep_gathered": bool}`` from a user's ``chunk_config_dict``.

    Accepts that dict itself, or ColossalAI's form keyed by data-parallel size
    (``{dp_size: {"chunk_size": ..., "keep_gathered": ...}}``, what its chunk search returns),
    from which the entry of ``dp_size`` is taken.

    Raises:
        TypeError: ``config`` is not a dict.
        ValueError: Unknown keys, no ``chunk_size``, a non-positive size, or no entry for
            ``dp_size``.
    """
    if config is None:
        return None
    if not isinstance(config, dict):
        raise TypeError(
            f"GeminiPlugin: chunk_config_dict must be a dict such as {{'chunk_size': 2**20}}, "
            f"got {type(config).__name__}"
        )
    if config and all(isinstance(k, int) and not isinstance(k, bool) for k in config):
        if dp_size not in config:
            raise ValueError(
                f"GeminiPlugin: chunk_config_dict is keyed by data-parallel size "
                f"{sorted(config)} but this job's is {dp_size}; add an entry for {dp_size} "
                "or pass {'chunk_size': ..., 'keep_gathered': ...} directly"
            )
        config = config[dp_size]
        if not isinstance(config, dict):
            raise TypeError(f"GeminiPlugin: chunk_config_dict[{dp_size}] must be a dict")
    unknown = set(config) - _CHUNK_KEYS
    if unknown or "chunk_size" not in config:
        raise ValueError(
            f"GeminiPlugin: chunk_config_dict takes the keys {sorted(_CHUNK_KEYS)} "
            f"('chunk_size' required), got {sorted(map(str, config))}"
        )
    size = config["chunk_size"]
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ValueError(
            f"GeminiPlugin: chunk_config_dict['chunk_size']={size!r} must be an int > 0 "
            "(elements per chunk)"
        )
    return {"chunk_size": size, "keep_gathered": bool(config.get("keep_gathered", False))}


@dataclasses.dataclass(frozen=True)
class GeminiConfig:
    """Validated settings of :class:`GeminiPlugin` (see its docstring for each field).

    Raises:
        ValueError: A value out of range (the message names it and the accepted range).
        TypeError: ``chunk_init_device`` is not a device.
    """

    placement_policy: str = "static"
    precision: str = "fp16"
    enable_gradient_accumulation: bool = False
    shard_param_frac: float = 1.0
    offload_optim_frac: float = 0.0
    offload_param_frac: float = 0.0
    warmup_non_model_data_ratio: float = 0.8
    steady_cuda_cap_ratio: float = 0.9
    master_weights: bool = True
    pin_memory: bool = False
    force_outputs_fp32: bool = False
    strict_ddp_mode: bool = False
    search_range_m: float = 32
    hidden_dim: int | None = None
    min_chunk_size_m: float = 32
    gpu_margin_mem_ratio: float = 0.0
    max_norm: float = 0.0
    norm_type: float = 2.0
    max_prefetch: int = 0
    chunk_init_device: torch.device | None = None
    scaler_config: ScalerConfig = dataclasses.field(default_factory=ScalerConfig)

    def __post_init__(self) -> None:
        if self.placement_policy not in _PLACEMENTS:
            raise ValueError(
                f"GeminiPlugin: placement_policy={self.placement_policy!r} is unknown; use "
                "'static' (fixed fractions) or 'auto' (traced, evicts to the host)"
            )
        precision = parse_precision(self.precision).value
        if precision not in _PRECISIONS:
            raise ValueError(
                f"GeminiPlugin: precision={self.precision!r} is not supported; use 'fp16', "
                "'bf16' or 'fp32'"
            )
        object.__setattr__(self, "precision", precision)
        for name in ("shard_param_frac", "offload_optim_frac", "offload_param_frac",
                     "warmup_non_model_data_ratio", "gpu_margin_mem_ratio"):  # fmt: skip
            object.__setattr__(self, name, _fraction(name, getattr(self, name)))
        ratio = _fraction("steady_cuda_cap_ratio", self.steady_cuda_cap_ratio, low_open=True)
        object.__setattr__(self, "steady_cuda_cap_ratio", ratio)
        object.__setattr__(self, "search_range_m", _positive("search_range_m",
                                                              self.search_range_m))
        object.__setattr__(self, "min_chunk_size_m", _positive(
            "min_chunk_size_m", self.min_chunk_size_m, allow_zero=True))
        if self.hidden_dim is not None and (
            isinstance(self.hidden_dim, bool) or not isinstance(self.hidden_dim, int)
            or self.hidden_dim <= 0
        ):
            raise ValueError(
                f"GeminiPlugin: hidden_dim={self.hidden_dim!r} must be an int > 0 (the "
                "model's hidden size) or None"
            )
        object.__setattr__(self, "max_norm", _positive(
            "max_norm (0 disables clipping)", self.max_norm, allow_zero=True))
        norm = self.norm_type
        if isinstance(norm, bool) or not isinstance(norm, int | float) or not norm > 0:
            raise ValueError(
                f"GeminiPlugin: norm_type={norm!r} must be > 0 (2.0 for the L2 norm, "
                "float('inf') for the max norm)"
            )
        object.__setattr__(self, "norm_type", float(norm))
        if isinstance(self.max_prefetch, bool) or not isinstance(self.max_prefetch, int) \
                or self.max_prefetch < 0:
            raise ValueError(
                f"GeminiPlugin: max_prefetch={self.max_prefetch!r} must be an int >= 0"
            )
        if self.chunk_init_device is not None:
            try:
                device = torch.device(self.chunk_init_device)
            except (TypeError, RuntimeError) as exc:
                raise TypeError(
                    f"GeminiPlugin: chunk_init_device={self.chunk_init_device!r} is not a "
                    "device; pass torch.device('cuda') / 'cpu' or None"
                ) from exc
            object.__setattr__(self, "chunk_init_device", device)
