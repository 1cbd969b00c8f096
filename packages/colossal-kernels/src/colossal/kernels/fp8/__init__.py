"""Float8 matmuls: ``linear_fp8`` (``torch._scaled_mm``) and the probe saying what is missing."""

from colossal.kernels.fp8.linear import linear_fp8
from colossal.kernels.fp8.probe import fp8_matmul_missing

__all__ = ["fp8_matmul_missing", "linear_fp8"]
