"""LowLevelZeroPlugin: ZeRO stage 1/2 behind the Booster API.

Wraps ``colossal.zero.LowLevelZeroOptimizer``; the model is cast to the training precision.
Optimizer checkpoints never hold the whole state on one rank: saving gathers each
parameter's state only while the rank writing it needs it, and loading reads only the rows
of each stored tensor that cover this rank's slice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from colossal.booster.plugin.base import DPPluginBase, materialize_model
from colossal.checkpoint_io import CheckpointError, CheckpointIO, TensorReader
from colossal.checkpoint_io.checkpoint_io import param_names, record_param_names
from colossal.checkpoint_io.optimizer_state import named_to_indexed
from colossal.core import ModelWrapper, get_accelerator, parse_precision
from colossal.zero import LowLevelZeroOptimizer
from colossal.zero.state_dict import (
    LocalRange,
    StateRef,
    StateSlice,
    gather_param_state,
    local_param_ranges,
    sharded_state_dict,
)

logger = logging.getLogger(__name__)

__all__ = ["LowLevelZeroModel", "LowLevelZeroPlugin", "ZeroPluginConfig"]


@dataclasses.dataclass(frozen=True)
class ZeroPluginConfig:
    """Validated settings of :class:`LowLevelZeroPlugin`."""

    stage: int = 1
    precision: str = "fp16"
    max_norm: float = 0.0
    norm_type: float = 2.0
    reduce_bucket_size_in_m: float = 12
    cpu_offload: bool = False

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


class ZeroCheckpointIO(CheckpointIO):
    """Checkpoint IO of ZeRO: sharded optimizer saves and loads, masters kept in sync.

    Saving hands the writer placeholders (full shape and dtype, one element of storage) for
    the sharded states; :meth:`to_full` gathers a parameter's state when the saver asks for
    it, and only the rank writing that key keeps it. Loading reads, per state, only the rows
    covering this rank's elements.
    """

    def __init__(self, group: Any = None) -> None:
        super().__init__(group)
        self.optimizers: list[LowLevelZeroOptimizer] = []
        self._refs: dict[tuple[Any, ...], tuple[LowLevelZeroOptimizer, StateRef]] = {}
        self._deferred = False

    def load_model_state(
        self, model: nn.Module, targets: dict[str, torch.Tensor], reader: TensorReader
    ) -> None:
        """Copy tensors in, then refresh the masters of every optimizer over this model."""
        super().load_model_state(model, targets, reader)
        params = list(model.parameters())
        for opt in self.optimizers:
            if any(opt.manages(p) for p in params):
                opt.sync_masters_from_params()

    # ---- save ------------------------------------------------------------------------------
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """Full per-parameter states; inside :meth:`save_optimizer`, placeholders instead.

        The placeholders (full shape and dtype, one element of storage) cost no communication;
        :meth:`to_full` gathers each when the saver asks for it.
        """
        if not self._deferred or not isinstance(optimizer, LowLevelZeroOptimizer):
            return super().optimizer_state(optimizer)
        state = sharded_state_dict(optimizer)
        for entries in state["state"].values():
            for name, value in entries.items():
                if isinstance(value, StateRef):
                    holder = torch.zeros((), dtype=value.dtype).expand(value.shape)
                    self._refs[_placeholder_key(holder)] = (optimizer, value)
                    entries[name] = holder
        return state

    def to_full(self, tensor: torch.Tensor, dst: int | None = None) -> torch.Tensor | None:
        """Gather a placeholder's state (collective); other tensors are returned as they are.

        With ``dst`` (a rank of this IO's group), only that rank receives the state; the
        others get ``None``.
        """
        found = self._refs.get(_placeholder_key(tensor)) if self._refs else None
        if found is None:
            return tensor
        optimizer, ref = found
        return gather_param_state(optimizer, ref, self._optimizer_rank(optimizer, dst))

    def _optimizer_rank(self, optimizer: LowLevelZeroOptimizer, dst: int | None) -> int | None:
        """``dst`` (a rank of this IO's group) as a rank of the optimizer's group, if in it."""
        if dst is None or not dist.is_initialized():
            return dst
        global_rank = dst if self.group is None else dist.get_global_rank(self.group, dst)
        ranks = list(optimizer._dp_ranks)
        return ranks.index(global_rank) if global_rank in ranks else None

    def save_optimizer(self, optimizer: Any, checkpoint: str, *args: Any, **kwargs: Any) -> None:
        """:meth:`CheckpointIO.save_optimizer` that gathers each state only for its writer."""
        self._deferred = True
        try:
            super().save_optimizer(optimizer, checkpoint, *args, **kwargs)
        finally:
            self._deferred = False
            self._refs.clear()

    # ---- load ------------------------------------------------------------------------------
    def load_optimizer_state(
        self, optimizer: Any, meta: dict[str, Any], reader: TensorReader
    ) -> None:
        """Read only this rank's part of each state (and of the fp32 masters when saved).

        Raises:
            CheckpointError: A stored state's shape differs from its parameter's.
        """
        names = param_names(optimizer)
        position = {n: i for i, n in enumerate(names)}
        ranges = local_param_ranges(optimizer)

        def read(param: str, key: str) -> Any:
            return _read_local(reader, key, ranges.get(position[param]))

        state = named_to_indexed(meta, reader.weight_map, names, read, keep=("master_param",))
        optimizer.load_state_dict(state)


def _placeholder_key(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    """Identity of a save placeholder (all strides 0), surviving ``detach()``."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0 or any(tensor.stride()):
        return None
    return (tensor.untyped_storage().data_ptr(), tuple(tensor.shape), tensor.dtype)


def _read_local(reader: TensorReader, key: str, local: LocalRange | None) -> Any:
    """The stored ``key``: whole when not per-parameter, else a :class:`StateSlice`.

    Reads the rows (dim 0) covering ``[local.start, local.stop)`` of the flattened tensor and
    trims them to those elements.
    """
    shape = reader.shape(key)
    if local is None or not shape:
        return reader.read(key)  # scalars (e.g. step) and states of untrained parameters
    if tuple(shape) != local.shape:
        raise CheckpointError(
            f"optimizer state {key!r} has shape {tuple(shape)} in the checkpoint but the "
            f"parameter has {local.shape}: the checkpoint belongs to another model"
        )
    row = math.prod(shape[1:])
    if row == 0 or local.start == local.stop:
        values = reader.read(key, slice(0, 0)).reshape(-1)
        return StateSlice(values, local.start, local.shape)
    first, last = local.start // row, -(-local.stop // row)
    rows = reader.read(key, slice(first, last)).reshape(-1)
    skip = local.start - first * row
    return StateSlice(rows[skip : skip + local.stop - local.start], local.start, local.shape)


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
        cpu_offload: Keep masters, their gradients and optimizer states on the CPU.
        master_weights: Keep fp32 master weights under fp16/bf16.
        verbose: Log overflows.
        dp_group: The data-parallel group (the whole job when None).
    """

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
        cpu_offload: bool = False,
        master_weights: bool = True,
        verbose: bool = False,
        dp_group: Any = None,
    ) -> None:
        super().__init__(dp_group)
        self.config = ZeroPluginConfig(
            stage,
            precision,
            float(max_norm),
            float(norm_type),
            reduce_bucket_size_in_m,
            cpu_offload,
        )
        self.zero_kwargs = {
            "partition_grad": stage == 2,
            "dp_process_group": dp_group,
            "initial_scale": initial_scale,
            "min_scale": min_scale,
            "growth_factor": growth_factor,
            "backoff_factor": backoff_factor,
            "growth_interval": growth_interval,
            "hysteresis": hysteresis,
            "max_scale": max_scale,
            "clip_grad_norm": float(max_norm),
            "norm_type": float(norm_type),
            "reduce_bucket_size": int(reduce_bucket_size_in_m * 1024**2),
            "communication_dtype": communication_dtype,
            "overlap_communication": overlap_communication,
            "cpu_offload": cpu_offload,
            "master_weights": master_weights,
            "verbose": verbose,
        }
        self._checkpoint_io = ZeroCheckpointIO(dp_group)

    @property
    def stage(self) -> int:
        """The ZeRO stage."""
        return self.config.stage

    def supported_devices(self) -> list[str]:
        """CPU and CUDA."""
        return ["cpu", "cuda"]

    def supported_precisions(self) -> list[str]:
        """fp16, bf16 and fp32."""
        return ["fp16", "bf16", "fp32"]

    def control_precision(self) -> bool:
        """True: the plugin casts the model itself."""
        return True

    def support_no_sync(self) -> bool:
        """Stage 1 only."""
        return self.config.stage == 1

    def configure(
        self,
        model: nn.Module,
        optimizer: Optimizer | None = None,
        criterion: Callable[..., Any] | None = None,
        dataloader: Any = None,
        lr_scheduler: Any = None,
    ) -> tuple[Any, Any, Any, Any, Any]:
        """Cast and move the model; wrap the optimizer in ``LowLevelZeroOptimizer``."""
        materialize_model(model, optimizer)
        dtype = parse_precision(self.config.precision).dtype
        model = model.to(device=get_accelerator().get_current_device(), dtype=dtype)
        if optimizer is not None:
            names = record_param_names(optimizer, model)
            optimizer = LowLevelZeroOptimizer(optimizer, **self.zero_kwargs)
            optimizer.colossal_param_names = names  # type: ignore[attr-defined]
            self._checkpoint_io.optimizers.append(optimizer)
        return LowLevelZeroModel(model, dtype), optimizer, criterion, dataloader, lr_scheduler

    def get_checkpoint_io(self) -> CheckpointIO:
        """Checkpoint IO that also refreshes the fp32 masters after a model load."""
        return self._checkpoint_io

    def no_sync(self, model: nn.Module, optimizer: Any = None) -> contextlib.AbstractContextManager:
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
