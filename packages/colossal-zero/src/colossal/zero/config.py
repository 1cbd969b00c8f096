"""Validated settings of the ZeRO optimizer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_COMM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class ZeroConfig:
    """Settings of :class:`~colossal.zero.LowLevelZeroOptimizer` other than the loss scaler."""

    partition_grad: bool = False
    clip_grad_norm: float = 0.0
    norm_type: float = 2.0
    reduce_bucket_size: int = 12 * 1024**2
    communication_dtype: torch.dtype | None = None
    overlap_communication: bool = True
    cpu_offload: bool = False
    master_weights: bool = True
    fp8_communication: bool = False

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.reduce_bucket_size, int) or self.reduce_bucket_size < 1:
            problems.append(
                f"reduce_bucket_size={self.reduce_bucket_size!r} must be a positive number "
                "of elements"
            )
        if not self.clip_grad_norm >= 0:
            problems.append(
                f"clip_grad_norm={self.clip_grad_norm!r} must be >= 0 (0 disables clipping)"
            )
        if not (self.norm_type == float("inf") or self.norm_type > 0):
            problems.append(f"norm_type={self.norm_type!r} must be > 0 or inf")
        if self.communication_dtype is not None and self.communication_dtype not in _COMM_DTYPES:
            problems.append(
                f"communication_dtype={self.communication_dtype!r} must be None, torch.float32, "
                "torch.float16 or torch.bfloat16"
            )
        if problems:
            raise ValueError("invalid LowLevelZeroOptimizer settings: " + "; ".join(problems))

    @property
    def stage(self) -> int:
        """ZeRO stage: 2 when gradients are partitioned, else 1."""
        return 2 if self.partition_grad else 1
