"""Validated settings of :class:`~colossal.booster.plugin.hybrid.HybridParallelPlugin`.

:class:`HybridConfig` checks every size and combination when the plugin is built, so a bad
layout fails before any model is touched, with the values and the fix in the message. What
depends on the model (heads divisible by the parallel sizes) or on the batch (microbatches
that divide it) is checked where it is known: by Shardformer when the model is sharded, by
the schedule when a batch arrives.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, TypedDict

from colossal.core import parse_precision

if TYPE_CHECKING:
    from colossal.shardformer import PipelineGradientCheckpointConfig

__all__ = [
    "PP_STYLES",
    "SP_MODES",
    "HybridConfig",
    "ShardConfigOptions",
    "ShardOptions",
    "unused_arguments",
]

PP_STYLES = ("1f1b", "interleaved", "zbv")
"""Pipeline schedules: 1F1B, interleaved 1F1B (several chunks per stage), zero-bubble V."""

SP_MODES = ("split_gather", "ring", "all_to_all", "ring_attn")
"""Sequence-parallel modes (Shardformer's); the first two run inside the tensor-parallel group."""

_TP_GROUP_MODES = ("split_gather", "ring")

TP_MODES = ("1d", "2d", "2.5d", "3d")
"""Tensor-parallel modes: Megatron's 1D, and the grids of SUMMA (2D), Tesseract (2.5D), 3D."""


def _size(name: str, value: object, allow_none: bool = False) -> None:
    if allow_none and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"HybridParallelPlugin: {name}={value!r} must be an int >= 1")


@dataclasses.dataclass(frozen=True)
class HybridConfig:
    """The layout and training settings of a hybrid-parallel job (validated).

    Attributes mirror the plugin's arguments; ``sp_size`` is resolved (1 when the sequence is
    not split over its own group) and ``world_size`` is the job's size the layout must fill.
    """

    tp_size: int
    pp_size: int
    world_size: int
    sp_size: int | None = None
    precision: str = "fp16"
    zero_stage: int = 0
    enable_sequence_parallelism: bool = False
    sequence_parallelism_mode: str | None = None
    num_microbatches: int | None = None
    microbatch_size: int | None = None
    pp_style: str = "1f1b"
    num_model_chunks: int = 1
    num_layers_per_stage: tuple[int, ...] | None = None
    max_norm: float = 0.0
    zero_bucket_size_in_m: float = 12
    dp_outside: bool = True
    tensor_parallel_mode: str = "1d"
    tp_depth: int = 1

    def __post_init__(self) -> None:
        _size("tp_size", self.tp_size)
        _size("pp_size", self.pp_size)
        _size("sp_size", self.sp_size, allow_none=True)
        _size("num_model_chunks", self.num_model_chunks)
        _size("num_microbatches", self.num_microbatches, allow_none=True)
        _size("microbatch_size", self.microbatch_size, allow_none=True)
        object.__setattr__(self, "precision", parse_precision(self.precision).value)
        if self.zero_stage not in (0, 1, 2):
            raise ValueError(
                f"HybridParallelPlugin: zero_stage={self.zero_stage!r} must be 0, 1 or 2 "
                "(use GeminiPlugin or TorchFSDPPlugin for ZeRO-3)"
            )
        if self.max_norm < 0:
            raise ValueError(
                f"HybridParallelPlugin: max_norm={self.max_norm!r} must be >= 0 (0 disables)"
            )
        if self.zero_bucket_size_in_m <= 0:
            raise ValueError(
                f"HybridParallelPlugin: zero_bucket_size_in_m={self.zero_bucket_size_in_m!r} "
                "must be > 0"
            )
        self._check_sequence()
        self._check_pipeline()
        self._check_tensor_parallel_mode()
        model_parallel = self.tp_size * self.pp_size * self.resolved_sp_size
        if self.world_size % model_parallel:
            raise ValueError(
                f"HybridParallelPlugin: tp_size={self.tp_size} x pp_size={self.pp_size} x "
                f"sp_size={self.resolved_sp_size} = {model_parallel} does not divide the "
                f"world size {self.world_size}; choose sizes whose product divides it "
                "(the data-parallel size is the quotient)"
            )

    def _check_sequence(self) -> None:
        mode = self.sequence_parallelism_mode
        if mode is not None and mode not in SP_MODES:
            raise ValueError(
                f"HybridParallelPlugin: sequence_parallelism_mode={mode!r} is not one of "
                f"{SP_MODES}"
            )
        if not self.enable_sequence_parallelism:
            if (self.sp_size or 1) > 1:
                raise ValueError(
                    f"HybridParallelPlugin: sp_size={self.sp_size!r} needs "
                    "enable_sequence_parallelism=True (and a sequence_parallelism_mode)"
                )
            # ColossalAI ignores the mode while sequence parallelism is off: so do we.
            object.__setattr__(self, "sequence_parallelism_mode", None)
            return
        if mode is None:
            object.__setattr__(self, "sequence_parallelism_mode", "split_gather")
            mode = "split_gather"
        if mode in _TP_GROUP_MODES:
            if (self.sp_size or 1) != 1:
                raise ValueError(
                    f"HybridParallelPlugin: sequence_parallelism_mode={mode!r} splits the "
                    f"sequence over the tensor-parallel group; sp_size={self.sp_size} must be "
                    "None or 1 (use 'all_to_all' or 'ring_attn' for a group of its own)"
                )
            if self.tp_size == 1:
                raise ValueError(
                    f"HybridParallelPlugin: sequence_parallelism_mode={mode!r} needs "
                    "tp_size > 1 (it splits the sequence over the tensor-parallel group); "
                    "use 'all_to_all' or 'ring_attn' with sp_size > 1 instead"
                )
        elif (self.sp_size or 1) == 1:
            raise ValueError(
                f"HybridParallelPlugin: sequence_parallelism_mode={mode!r} needs sp_size > 1 "
                f"(got sp_size={self.sp_size!r})"
            )

    def _check_pipeline(self) -> None:
        if self.pp_style not in PP_STYLES:
            raise ValueError(
                f"HybridParallelPlugin: pp_style={self.pp_style!r} must be one of {PP_STYLES}"
            )
        if self.pp_size == 1:
            return
        if self.zero_stage == 2:
            raise ValueError(
                f"HybridParallelPlugin: zero_stage=2 with pp_size={self.pp_size}: ZeRO-2 keeps "
                "no local gradients to accumulate microbatches in; use zero_stage=1 (or 0)"
            )
        if self.num_microbatches is None and self.microbatch_size is None:
            raise ValueError(
                f"HybridParallelPlugin: pp_size={self.pp_size} needs num_microbatches or "
                "microbatch_size"
            )
        chunks = self.num_model_chunks
        if self.pp_style == "1f1b" and chunks != 1:
            raise ValueError(
                f"HybridParallelPlugin: pp_style='1f1b' runs one model chunk per stage, got "
                f"num_model_chunks={chunks}; use pp_style='interleaved' for several"
            )
        if self.pp_style == "interleaved" and chunks < 2:
            raise ValueError(
                "HybridParallelPlugin: pp_style='interleaved' needs num_model_chunks >= 2, got "
                f"{chunks}"
            )
        if self.pp_style == "zbv" and chunks != 2:
            raise ValueError(
                f"HybridParallelPlugin: pp_style='zbv' runs 2 model chunks per stage (a V), got "
                f"num_model_chunks={chunks}"
            )
        layers = self.num_layers_per_stage
        if layers is not None and len(layers) != self.pp_size * chunks:
            raise ValueError(
                f"HybridParallelPlugin: num_layers_per_stage={list(layers)} has {len(layers)} "
                f"entries; give one per stage and chunk ({self.pp_size} x {chunks})"
            )

    def _check_tensor_parallel_mode(self) -> None:
        mode, depth = self.tensor_parallel_mode, self.tp_depth
        if mode not in TP_MODES:
            raise ValueError(
                f"HybridParallelPlugin: tensor_parallel_mode={mode!r} must be one of {TP_MODES}"
            )
        _size("tp_depth", depth)
        if depth != 1 and mode != "2.5d":
            raise ValueError(
                f"HybridParallelPlugin: tp_depth={depth} applies to tensor_parallel_mode='2.5d' "
                f"only (got {mode!r}); leave it at 1"
            )
        if mode == "1d":
            return
        for what, on in (
            (f"pp_size={self.pp_size}", self.pp_size > 1),
            ("enable_sequence_parallelism=True", self.enable_sequence_parallelism),
        ):
            if on:
                raise ValueError(
                    f"HybridParallelPlugin: tensor_parallel_mode={mode!r} does not support "
                    f"{what} yet; use tensor_parallel_mode='1d' for it"
                )

    @property
    def grid_tp_mode(self) -> str | None:
        """``ParallelDims``' ``tp_mode``: None for 1D, else the grid mode."""
        return None if self.tensor_parallel_mode == "1d" else self.tensor_parallel_mode

    @property
    def resolved_sp_size(self) -> int:
        """Ranks of the sequence-parallel group of its own (1 for the TP-group modes)."""
        return self.sp_size or 1

    @property
    def dp_size(self) -> int:
        """Data-parallel size: what tp x pp x sp leaves of the world."""
        return self.world_size // (self.tp_size * self.pp_size * self.resolved_sp_size)

    @property
    def sp_group_of_its_own(self) -> bool:
        """Whether the sequence is split over a group other than the tensor-parallel one."""
        return self.enable_sequence_parallelism and self.sequence_parallelism_mode not in (
            _TP_GROUP_MODES
        )


class ShardConfigOptions(TypedDict):
    """The ``colossal.shardformer.ShardConfig`` keyword arguments of :class:`ShardOptions`."""

    enable_all_optimization: bool
    enable_fused_normalization: bool
    enable_flash_attention: bool
    enable_jit_fused: bool
    enable_sequence_overlap: bool
    parallel_output: bool
    make_vocab_size_divisible_by: int
    gradient_checkpoint_config: PipelineGradientCheckpointConfig | None


@dataclasses.dataclass(frozen=True)
class ShardOptions:
    """Shardformer's optimizations and model settings of a hybrid-parallel job.

    Attributes mirror the plugin's arguments of the same names; :meth:`shard_config_kwargs`
    gives them to ``ShardConfig``.
    """

    enable_all_optimization: bool = False
    enable_fused_normalization: bool = False
    enable_flash_attention: bool = False
    enable_jit_fused: bool = False
    enable_sequence_overlap: bool = False
    parallel_output: bool = True
    make_vocab_size_divisible_by: int = 64
    gradient_checkpoint_config: PipelineGradientCheckpointConfig | None = None

    def __post_init__(self) -> None:
        _size("make_vocab_size_divisible_by", self.make_vocab_size_divisible_by)

    def shard_config_kwargs(self) -> ShardConfigOptions:
        """The ``ShardConfig`` keyword arguments they stand for (every field)."""
        return ShardConfigOptions(
            enable_all_optimization=self.enable_all_optimization,
            enable_fused_normalization=self.enable_fused_normalization,
            enable_flash_attention=self.enable_flash_attention,
            enable_jit_fused=self.enable_jit_fused,
            enable_sequence_overlap=self.enable_sequence_overlap,
            parallel_output=self.parallel_output,
            make_vocab_size_divisible_by=self.make_vocab_size_divisible_by,
            gradient_checkpoint_config=self.gradient_checkpoint_config,
        )


_DDP_DEFAULTS = {
    "broadcast_buffers": True,
    "ddp_bucket_cap_mb": 25,
    "find_unused_parameters": False,
    "check_reduction": False,
    "gradient_as_bucket_view": False,
    "static_graph": False,
}
"""ColossalAI's torch-DDP arguments of the plugin, with their defaults."""


def unused_arguments(ddp: Mapping[str, bool | int], enable_jit_fused: bool) -> list[str]:
    """The arguments set to something that has no effect here (for a one-time warning).

    The gradients of every layout are reduced in ZeRO's buckets (see the plugin's
    ``zero_stage``), so torch DDP's six settings do nothing; Shardformer has no JIT-fused
    kernels to enable.
    """
    changed = [f"{k}={v!r}" for k, v in ddp.items() if v != _DDP_DEFAULTS[k]]
    if enable_jit_fused:
        changed.append("enable_jit_fused=True")
    return changed
