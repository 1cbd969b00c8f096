"""LowLevelZeroPlugin: ZeRO stage 1/2 behind the Booster API.

Wraps ``colossal.zero.LowLevelZeroOptimizer``; the model is cast to the training precision.
Its checkpoint IO (sharded optimizer saves and loads) is
:class:`colossal.booster.plugin.zero.ZeroCheckpointIO`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, TypedDict

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from colossal.booster.plugin.base import (
    Boosted,
    Criterion,
    DPPluginBase,
    materialize_model,
    warn_if_slow_precision,
)
from colossal.booster.plugin.zero.checkpoint_io import ZeroCheckpointIO
from colossal.checkpoint_io import CheckpointIO
from colossal.checkpoint_io.names import group_param_names
from colossal.core import (
    ModelWrapper,
    OptimizerWrapper,
    ScalerConfig,
    get_accelerator,
    parse_precision,
)
from colossal.zero import LowLevelZeroOptimizer

logger = logging.getLogger(__name__)

__all__ = ["LowLevelZeroModel", "LowLevelZeroPlugin", "ZeroOptimizerKwargs", "ZeroPluginConfig"]


@dataclasses.dataclass(frozen=True)
class ZeroPluginConfig:
    """Validated settings of :class:`LowLevelZeroPlugin`."""

    stage: int = 1
    precision: str = "fp16"
    max_norm: float = 0.0
    norm_type: float = 2.0
    reduce_bucket_size_in_m: float = 12
    cpu_offload: bool = False
    scaler_config: ScalerConfig = dataclasses.field(default_factory=ScalerConfig)

    def __post_init__(self) -> None:
        if self.stage not in (1, 2):
            raise ValueError(
                f"LowLevelZeroPlugin supports stage 1 or 2, got stage={self.stage!r}; use "
                "TorchFSDPPlugin (or Gemini) for ZeRO-3"
            )
        object.__setattr__(self, "precision", parse_precision(self.precision).value)
        if self.max_norm < 0:
            raise ValueError(f"max_norm must be >= 0 (0 disables clipping), got {self.max_norm}")
        if self.reduce_bucket_size_in_m <= 0:
            raise ValueError(
                f"reduce_bucket_size_in_m must be > 0, got {self.reduce_bucket_size_in_m}"
            )


class ZeroOptimizerKwargs(TypedDict):
    """The keyword arguments :class:`LowLevelZeroPlugin` gives ``LowLevelZeroOptimizer``."""

    partition_grad: bool
    dp_process_group: dist.ProcessGroup | None
    scaler_config: ScalerConfig
    clip_grad_norm: float
    norm_type: float
    reduce_bucket_size: int
    communication_dtype: torch.dtype | None
    overlap_communication: bool
    overlap_allgather: bool
    cpu_offload: bool
    master_weights: bool
    verbose: bool
    fp8_communication: bool


class LowLevelZeroModel(ModelWrapper):
    """The model of a ZeRO run: parameters cast to the training precision.

    Inputs in floating point are cast to the same dtype, as ColossalAI does.
    """

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        super().__init__(module)
        self.dtype = dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Call the module with floating-point tensor inputs cast to the model's dtype."""
        args = tuple(self._cast(a) for a in args)
        kwargs = {k: self._cast(v) for k, v in kwargs.items()}
        return self.module(*args, **kwargs)

    def _cast(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(self.dtype)
        return value


class LowLevelZeroPlugin(DPPluginBase):
    """ZeRO stage 1 (optimizer states sharded) or 2 (gradients too) on ``colossal.zero``.

    The model is cast to ``precision`` (fp16/bf16 keep fp32 master weights; fp16 uses a
    dynamic loss scaler), so the plugin controls precision and the Booster must not.

    Args:
        stage: 1 or 2.
        precision: ``"fp16"``, ``"bf16"`` or ``"fp32"``.
        initial_scale: Loss scaler: initial scale.
        min_scale: Loss scaler: smallest scale.
        growth_factor: Loss scaler: growth multiplier.
        backoff_factor: Loss scaler: backoff multiplier.
        growth_interval: Loss scaler: clean steps between growths.
        hysteresis: Loss scaler: overflows tolerated before a backoff.
        max_scale: Loss scaler: largest scale.
        max_norm: Clip gradients to this global norm (0: no clipping).
        norm_type: Norm of the clipping.
        reduce_bucket_size_in_m: Gradient bucket size in millions of elements.
        communication_dtype: dtype gradients are reduced in (the params' by default).
        overlap_communication: Reduce buckets during backward.
        overlap_allgather: Let the next forward overlap the parameter all-gather after a step
            (every read of a parameter still waits for its own bucket). On by default
            (ColossalAI's default is off; ours is safe to read at any time).
        cpu_offload: Keep masters, their gradients and optimizer states on the CPU.
        master_weights: Keep fp32 master weights under fp16/bf16.
        verbose: Log overflows.
        dp_group: The data-parallel group (the whole job when None); ZeRO shards over
            ``self.parallel_dims.group("dp")``.
        fp8_communication: Reduce the gradients and all-gather the parameters as float8
            (``LowLevelZeroOptimizer(fp8_communication=True)``: a quarter of the bytes, no
            overlap). The norm's and the loss scaler's small all-reduces stay fp32.
    """

    SUPPORTED_PRECISIONS = ("fp16", "bf16", "fp32")
    CONTROLS_PRECISION = True
    SUPPORTS_LORA = True

    def __init__(
        self,
        stage: int = 1,
        precision: str = "fp16",
        initial_scale: float = 2**32,
        min_scale: float = 1,
        growth_factor: float = 2,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        max_scale: float = 2**32,
        max_norm: float = 0.0,
        norm_type: float = 2.0,
        reduce_bucket_size_in_m: int = 12,
        communication_dtype: torch.dtype | None = None,
        overlap_communication: bool = True,
        overlap_allgather: bool = True,
        cpu_offload: bool = False,
        master_weights: bool = True,
        verbose: bool = False,
        dp_group: dist.ProcessGroup | None = None,
        fp8_communication: bool = False,
    ) -> None:
        super().__init__(dp_group)
        self.config = ZeroPluginConfig(
            stage,
            precision,
            float(max_norm),
            float(norm_type),
            reduce_bucket_size_in_m,
            cpu_offload,
            ScalerConfig(
                initial_scale=initial_scale,
                min_scale=min_scale,
                growth_factor=growth_factor,
                backoff_factor=backoff_factor,
                growth_interval=growth_interval,
                hysteresis=hysteresis,
                max_scale=max_scale,
            ),
        )
        self.zero_kwargs: ZeroOptimizerKwargs = {
            "partition_grad": stage == 2,
            "dp_process_group": self.dp_group,
            "scaler_config": self.config.scaler_config,
            "clip_grad_norm": float(max_norm),
            "norm_type": float(norm_type),
            "reduce_bucket_size": int(reduce_bucket_size_in_m * 1024**2),
            "communication_dtype": communication_dtype,
            "overlap_communication": overlap_communication,
            "overlap_allgather": overlap_allgather,
            "cpu_offload": cpu_offload,
            "master_weights": master_weights,
            "verbose": verbose,
            "fp8_communication": bool(fp8_communication),
        }
        self._checkpoint_io = ZeroCheckpointIO(self.dp_group)
        warn_if_slow_precision("LowLevelZeroPlugin", self.config.precision)

    @property
    def stage(self) -> int:
        """The ZeRO stage."""
        return self.config.stage

    @property
    def precision(self) -> str:
        """The training precision (``"fp16"``, ``"bf16"`` or ``"fp32"``; ColossalAI's)."""
        return self.config.precision

    def support_no_sync(self) -> bool:
        """Stage 1 only."""
        return self.config.stage == 1

    def configure(
        self,
        model: nn.Module,
        optimizer: Optimizer | None = None,
        criterion: Criterion | None = None,
        dataloader: DataLoader | None = None,
        lr_scheduler: LRScheduler | None = None,
    ) -> Boosted:
        """Cast and move the model; wrap the optimizer in ``LowLevelZeroOptimizer``."""
        materialize_model(model, optimizer)
        dtype = parse_precision(self.config.precision).dtype
        moved = model.to(device=get_accelerator().get_current_device(), dtype=dtype)
        zero = None
        if optimizer is not None:
            names = group_param_names(optimizer, moved)
            zero = LowLevelZeroOptimizer(optimizer, **self.zero_kwargs)
            zero.set_param_names(names)
            self._checkpoint_io.optimizers.append(zero)
        return Boosted(LowLevelZeroModel(moved, dtype), zero, criterion, dataloader, lr_scheduler)

    def get_checkpoint_io(self) -> CheckpointIO:
        """Checkpoint IO that also refreshes the fp32 masters after a model load."""
        return self._checkpoint_io

    def no_sync(
        self, model: nn.Module | None, optimizer: OptimizerWrapper | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """The optimizer's ``no_sync`` (stage 1 only).

        Raises:
            NotImplementedError: Under stage 2.
            TypeError: No boosted optimizer given.
        """
        if self.config.stage != 1:
            raise NotImplementedError(
                "LowLevelZeroPlugin(stage=2) does not support no_sync(); use stage=1 or call "
                "booster.backward for every micro-batch"
            )
        if not isinstance(optimizer, LowLevelZeroOptimizer):
            raise TypeError("no_sync under ZeRO needs the optimizer returned by boost()")
        return optimizer.no_sync()
