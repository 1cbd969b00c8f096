"""``linear_fp8``: ``F.linear`` whose three matmuls run in float8 through ``torch._scaled_mm``.

Forward: ``x`` and ``weight`` are quantized to e4m3 with one dynamic scale each
(``amax / 448``); backward: the output gradient is quantized to e5m2 (``amax / 57344``, wider
range for gradients) and multiplied with the saved e4m3 operands. Every product accumulates in
float32 and is dequantized by the two scales. ``torch._scaled_mm`` wants its first operand
row-major and its second column-major, and on CUDA every dim a multiple of 16: operands are
zero-padded to multiples of 16 (zeros change neither the amax nor the products) and the
result cut back.
"""

from __future__ import annotations

import torch
from torch.autograd.function import FunctionCtx
from torch.nn import functional as F  # noqa: N812

__all__ = ["linear_fp8"]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
_ALIGN = 16


def _quantize(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` as ``dtype`` scaled so its amax lands on the format's max, and the scale."""
    t32 = t.float()
    amax = t32.abs().amax().clamp(min=1e-12)
    scale = amax / torch.finfo(dtype).max
    return (t32 / scale).to(dtype), scale


def _pad2(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``t`` (2-D) zero-padded at the end to ``rows x cols``."""
    r, c = t.shape
    if (r, c) == (rows, cols):
        return t
    return F.pad(t, (0, cols - c, 0, rows - r))


def _unpad(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The leading ``rows x cols`` block of ``t``, as a tensor of its own (not a view)."""
    return t if t.shape == (rows, cols) else t[:rows, :cols].clone()


def _up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _mm(
    a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, out: torch.dtype
) -> torch.Tensor:
    """``(a * sa) @ (b * sb)`` in float32 accumulation: ``a`` made row-major, ``b`` column-major."""
    return torch._scaled_mm(
        a.contiguous(), b.t().contiguous().t(), scale_a=sa, scale_b=sb, out_dtype=out
    )


class _LinearFp8(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        (m, k), n = x.shape, weight.shape[0]
        mp, kp, np_ = _up(m), _up(k), _up(n)
        xq, sx = _quantize(_pad2(x, mp, kp), E4M3)
        wq, sw = _quantize(_pad2(weight, np_, kp), E4M3)
        y = _unpad(_mm(xq, wq.t(), sx, sw, x.dtype), m, n)
        if bias is not None:
            y = y + bias.to(y.dtype)
        ctx.save_for_backward(xq, wq, sx, sw)
        ctx.sizes = (m, k, n)  # type: ignore[attr-defined]
        ctx.dtypes = (x.dtype, weight.dtype)  # type: ignore[attr-defined]
        ctx.has_bias = bias is not None  # type: ignore[attr-defined]
        return y

    @staticmethod
    def backward(
        ctx: FunctionCtx, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        xq, wq, sx, sw = ctx.saved_tensors  # type: ignore[attr-defined]
        m, k, n = ctx.sizes  # type: ignore[attr-defined]
        x_dtype, w_dtype = ctx.dtypes  # type: ignore[attr-defined]
        gq, sg = _quantize(_pad2(grad_out, xq.shape[0], wq.shape[0]), E5M2)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:  # type: ignore[attr-defined]
            grad_x = _unpad(_mm(gq, wq, sg, sw, x_dtype), m, k)
        if ctx.needs_input_grad[1]:  # type: ignore[attr-defined]
            grad_w = _unpad(_mm(gq.t(), xq, sg, sx, torch.float32), n, k).to(w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:  # type: ignore[attr-defined]
            grad_b = grad_out.float().sum(0).to(w_dtype)
        return grad_x, grad_w, grad_b


def linear_fp8(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with its forward and backward matmuls in float8.

    ``x``: ``(..., in)``; ``weight``: ``(out, in)``; output in ``x``'s dtype. Each element of a
    product carries at most the e4m3 rounding of both operands (relative ``2**-4`` each) in the
    forward, e5m2 (``2**-3``) for the output gradient in the backward; the bias and its gradient
    stay in full precision. Check availability with
    :func:`colossal.kernels.fp8.fp8_matmul_missing`.

    Raises:
        ValueError: ``weight`` is not 2-D or its in-features differ from ``x``'s last dim.
        TypeError: A tensor is not floating point.
    """
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None and not t.is_floating_point():
            raise TypeError(f"linear_fp8: {name} has dtype {t.dtype}; pass a floating tensor")
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"linear_fp8: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not chain; "
            "weight must be (out_features, in_features) with in_features == x.shape[-1]"
        )
    out: torch.Tensor = _LinearFp8.apply(x.reshape(-1, x.shape[-1]), weight, bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])
