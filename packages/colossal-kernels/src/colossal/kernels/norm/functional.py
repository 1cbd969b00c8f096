"""Fused LayerNorm / RMSNorm as autograd functions dispatched through the kernel registry.

Implementations (kernel names ``"layer_norm"`` and ``"rms_norm"``):

* ``triton``: one fused forward and one fused backward kernel (GPU; CPU under
  ``TRITON_INTERPRET=1`` for tests).
* ``aten``: the fused ATen kernels (``native_layer_norm`` and its backward;
  ``_fused_rms_norm`` forward with a torch-ops backward), the fastest correct path on CPU.
* ``torch`` (RMSNorm only, when ATen has no fused RMSNorm): the formula in torch ops.

Statistics are computed in fp32 for every input dtype; outputs have the input's dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from colossal.kernels.registry import REGISTRY


class NormImpl(NamedTuple):
    """Forward and backward of one norm implementation on ``[M, N]`` rows.

    ``forward(x2d, weight, bias, eps) -> (y, mean, rstd)`` and
    ``backward(dy, x2d, weight, bias_dtype, mean, rstd) -> (dx, dweight, dbias)``.
    """

    name: str
    forward: Any
    backward: Any


def _check(x: torch.Tensor, shape: tuple[int, ...], weight: torch.Tensor | None,
           bias: torch.Tensor | None) -> None:
    if tuple(x.shape[x.dim() - len(shape):]) != shape or x.dim() < len(shape):
        raise ValueError(
            f"input of shape {tuple(x.shape)} does not end with normalized_shape {shape}; "
            "pass the trailing dimensions being normalized"
        )
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} of shape {tuple(t.shape)} must have shape {shape}")


class _FusedNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, shape: tuple[int, ...], weight: torch.Tensor | None,
                bias: torch.Tensor | None, eps: float, rms: bool) -> torch.Tensor:
        impl: NormImpl = REGISTRY.get("rms_norm" if rms else "layer_norm", x.device)
        n = 1
        for d in shape:
            n *= d
        x2d = x.contiguous().view(-1, n)
        y, mean, rstd = impl.forward(x2d, weight, bias, eps)
        ctx.save_for_backward(x2d, weight, mean, rstd)
        ctx.impl, ctx.in_shape = impl, x.shape
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y.view(x.shape)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        x2d, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = ctx.impl.backward(dy.contiguous().view(x2d.shape), x2d, weight,
                                       ctx.bias_dtype, mean, rstd)
        return dx.view(ctx.in_shape), None, dw, db, None, None


def _shape(normalized_shape: int | Sequence[int]) -> tuple[int, ...]:
    if isinstance(normalized_shape, int):
        return (normalized_shape,)
    return tuple(int(d) for d in normalized_shape)


def fused_layer_norm(x: torch.Tensor, normalized_shape: int | Sequence[int],
                     weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                     eps: float = 1e-5) -> torch.Tensor:
    """``torch.nn.functional.layer_norm`` through the fastest available fused kernel.

    Raises:
        ValueError: The shapes do not match.
    """
    shape = _shape(normalized_shape)
    _check(x, shape, weight, bias)
    return _FusedNorm.apply(x, shape, weight, bias, float(eps), False)


def fused_rms_norm(x: torch.Tensor, normalized_shape: int | Sequence[int],
                   weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm ``x * rsqrt(mean(x**2) + eps) * weight`` (statistics in fp32), fused.

    Raises:
        ValueError: The shapes do not match.
    """
    shape = _shape(normalized_shape)
    _check(x, shape, weight, None)
    return _FusedNorm.apply(x, shape, weight, None, float(eps), True)


# ---- implementations ----------------------------------------------------------------------
def _aten_ln_forward(x2d: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.ops.aten.native_layer_norm(x2d, [x2d.shape[1]], w, b, eps)


def _aten_ln_backward(dy: torch.Tensor, x2d: torch.Tensor, w: torch.Tensor | None,
                      bias_dtype: torch.dtype | None, mean: torch.Tensor, rstd: torch.Tensor,
                      ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    n = x2d.shape[1]
    bias = torch.empty(n, dtype=bias_dtype, device=x2d.device) if bias_dtype else None
    dx, dw, db = torch.ops.aten.native_layer_norm_backward(
        dy, x2d, [n], mean, rstd, w, bias, [True, w is not None, bias is not None])
    return dx, dw, db


def _aten_rms_forward(x2d: torch.Tensor, w: torch.Tensor | None, b: None, eps: float
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y, rstd = torch.ops.aten._fused_rms_norm(x2d, [x2d.shape[1]], w, eps)
    return y, rstd.new_empty(0), rstd


def _torch_rms_forward(x2d: torch.Tensor, w: torch.Tensor | None, b: None, eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    xf = x2d.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = xf * rstd
    if w is not None:
        y = y * w.float()
    return y.to(x2d.dtype), xf.new_empty(0), rstd.view(-1)


def _torch_rms_backward(dy: torch.Tensor, x2d: torch.Tensor, w: torch.Tensor | None,
                        bias_dtype: None, mean: torch.Tensor, rstd: torch.Tensor,
                        ) -> tuple[torch.Tensor, torch.Tensor | None, None]:
    xhat = x2d.float() * rstd.view(-1, 1)
    dyf = dy.float()
    wdy = dyf * w.float() if w is not None else dyf
    c1 = (xhat * wdy).mean(-1, keepdim=True)
    dx = (wdy - xhat * c1) * rstd.view(-1, 1)
    dw = (dyf * xhat).sum(0).to(w.dtype) if w is not None else None
    return dx.to(x2d.dtype), dw, None


def _triton_impl(rms: bool) -> NormImpl:
    from colossal.kernels._triton import norms

    def forward(x2d: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None,
                eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return norms.norm_forward(x2d, w, b, eps, rms)

    def backward(dy: torch.Tensor, x2d: torch.Tensor, w: torch.Tensor | None,
                 bias_dtype: torch.dtype | None, mean: torch.Tensor, rstd: torch.Tensor,
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        return norms.norm_backward(dy, x2d, w, bias_dtype, mean, rstd, rms)

    return NormImpl("triton", forward, backward)


def load_triton_layer_norm() -> NormImpl:
    """The Triton LayerNorm (imports Triton)."""
    return _triton_impl(False)


def load_triton_rms_norm() -> NormImpl:
    """The Triton RMSNorm (imports Triton)."""
    return _triton_impl(True)


ATEN_LAYER_NORM = NormImpl("aten", _aten_ln_forward, _aten_ln_backward)
# ATen has no CPU kernel for _fused_rms_norm_backward; the backward is the torch formula.
ATEN_RMS_NORM = NormImpl("aten", _aten_rms_forward, _torch_rms_backward)
TORCH_RMS_NORM = NormImpl("torch", _torch_rms_forward, _torch_rms_backward)
