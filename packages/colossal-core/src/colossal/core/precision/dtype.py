"""Parsing the ``precision`` argument every plugin and optimizer accepts."""

from __future__ import annotations

import enum

import torch


class Precision(str, enum.Enum):
    """Training precision: parameters' compute dtype; master weights stay fp32."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype of this precision."""
        return _DTYPES[self]

    @property
    def needs_loss_scaling(self) -> bool:
        """fp16 gradients underflow without a loss scaler; bf16 and fp32 do not."""
        return self is Precision.FP16

    @classmethod
    def from_dtype(cls, dtype: torch.dtype) -> Precision:
        """The precision whose dtype is ``dtype``.

        Raises:
            ValueError: ``dtype`` is not fp32, fp16 or bf16.
        """
        for precision, value in _DTYPES.items():
            if value == dtype:
                return precision
        raise ValueError(
            f"no training precision for dtype {dtype}; use float32, float16 or bfloat16"
        )


_DTYPES = {
    Precision.FP32: torch.float32,
    Precision.FP16: torch.float16,
    Precision.BF16: torch.bfloat16,
}
_ALIASES = {
    "fp32": Precision.FP32,
    "float32": Precision.FP32,
    "float": Precision.FP32,
    "32": Precision.FP32,
    "fp16": Precision.FP16,
    "float16": Precision.FP16,
    "half": Precision.FP16,
    "16": Precision.FP16,
    "bf16": Precision.BF16,
    "bfloat16": Precision.BF16,
}


def parse_precision(value: str | torch.dtype | Precision) -> Precision:
    """Turn ``"fp32" | "fp16" | "bf16"`` (or a dtype, or a common alias) into a :class:`Precision`.

    Raises:
        TypeError: ``value`` is neither a string nor a dtype.
        ValueError: an unknown precision name.
    """
    if isinstance(value, Precision):
        return value
    if isinstance(value, torch.dtype):
        return Precision.from_dtype(value)
    if not isinstance(value, str):
        raise TypeError(
            "precision must be a string like 'bf16' or a torch.dtype, "
            f"got {type(value).__name__} {value!r}"
        )
    key = value.strip().lower().removeprefix("torch.")
    if key not in _ALIASES:
        raise ValueError(f"unknown precision {value!r}; choose one of 'fp32', 'fp16', 'bf16'")
    return _ALIASES[key]
