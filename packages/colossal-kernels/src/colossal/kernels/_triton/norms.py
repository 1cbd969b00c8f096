# ruff: noqa: N803 - Triton kernels name pointer and constexpr arguments in capitals
"""LayerNorm and RMSNorm forward/backward in Triton (rows of a 2-D ``[M, N]`` view).

Forward: one program per row, statistics in fp32, saves ``mean`` (LayerNorm) and ``rstd``.
Backward: each of ``G`` programs handles rows ``pid, pid + G, ...``, writes ``dx`` and
accumulates its partial ``dweight``/``dbias`` in fp32; the partials are summed on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_FUSED_BYTES = 65536


def _block(n: int, x: torch.Tensor) -> int:
    block = triton.next_power_of_2(n)
    if block * x.element_size() > MAX_FUSED_BYTES:
        raise ValueError(f"normalized size {n} is too large for the fused Triton norm kernel")
    return block


@triton.jit
def _norm_fwd(X, Y, W, B, MEAN, RSTD, stride, N, eps,
              RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    if RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=0) / N
        tl.store(MEAN + row, mean)
        xc = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / N + eps)
    tl.store(RSTD + row, rstd)
    y = xc * rstd
    if HAS_W:
        y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        y = y + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd(X, DY, DX, W, MEAN, RSTD, DW, DB, stride, M, N, G,
              RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.full((BLOCK,), 1.0, tl.float32)
    if HAS_W:
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), tl.float32)
    db = tl.zeros((BLOCK,), tl.float32)
    for row in range(pid, M, G):
        off = tl.cast(row, tl.int64) * stride
        x = tl.load(X + off + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + off + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        if RMS:
            xhat = x * rstd
        else:
            xhat = tl.where(mask, (x - tl.load(MEAN + row)) * rstd, 0.0)
        wdy = w * dy
        c1 = tl.sum(xhat * wdy, axis=0) / N
        if RMS:
            dx = (wdy - xhat * c1) * rstd
        else:
            c2 = tl.sum(wdy, axis=0) / N
            dx = (wdy - (xhat * c1 + c2)) * rstd
        tl.store(DX + off + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
        db += dy
    if HAS_W:
        tl.store(DW + pid * N + cols, dw, mask=mask)
    if HAS_B:
        tl.store(DB + pid * N + cols, db, mask=mask)


def norm_forward(x2d: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                 eps: float, rms: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, mean, rstd)`` for a contiguous ``[M, N]`` input (``mean`` empty for RMSNorm)."""
    m, n = x2d.shape
    y = torch.empty_like(x2d)
    mean = torch.empty(m if not rms else 0, dtype=torch.float32, device=x2d.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x2d.device)
    if m:
        _norm_fwd[(m,)](x2d, y, weight, bias, mean, rstd, x2d.stride(0), n, eps, RMS=rms,
                        HAS_W=weight is not None, HAS_B=bias is not None, BLOCK=_block(n, x2d))
    return y, mean, rstd


def norm_backward(dy: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor | None,
                  bias_dtype: torch.dtype | None, mean: torch.Tensor, rstd: torch.Tensor, rms: bool,
                  ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(dx, dweight, dbias)`` for the forward above (``None`` where absent)."""
    has_bias = bias_dtype is not None
    m, n = x2d.shape
    dx = torch.empty_like(x2d)
    if x2d.device.type == "cuda":
        sms = torch.cuda.get_device_properties(x2d.device).multi_processor_count
        groups = max(1, min(m, 4 * sms))
    else:
        groups = max(1, min(m, 8))
    dw = torch.empty((groups, n), dtype=torch.float32, device=x2d.device)
    db = torch.empty((groups, n), dtype=torch.float32, device=x2d.device)
    if m:
        _norm_bwd[(groups,)](x2d, dy, dx, weight, mean, rstd, dw, db, x2d.stride(0), m, n,
                             groups, RMS=rms, HAS_W=weight is not None, HAS_B=has_bias,
                             BLOCK=_block(n, x2d))
    else:
        dw.zero_()
        db.zero_()
    dweight = dw.sum(0).to(weight.dtype) if weight is not None else None
    dbias = db.sum(0).to(bias_dtype) if bias_dtype is not None else None
    return dx, dweight, dbias
