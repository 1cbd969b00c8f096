"""Causal flash attention on CPU, tiled so that no work is spent above the diagonal.

PyTorch's CPU flash kernel (``aten._scaled_dot_product_flash_attention_for_cpu`` and its
backward) applies ``is_causal`` per query block of up to 256 rows: every block computes the
scores of its whole rectangle up to its last row and masks the upper triangle afterwards, so
about a quarter of a 2048-token causal attention is computed and thrown away, forward and
backward. This module feeds the same kernel with a decomposition of the causal triangle into
pieces of which only the diagonal ones are masked, and those are small.

With ``S = n * blk`` and ``n = 2**L``:

1. one causal call on the ``n`` diagonal ``blk``-blocks, moved into the batch dimension;
2. for each width ``w = S/2, S/4, ..., blk``: one non-causal call of every odd ``w``-block's
   queries against the preceding even ``w``-block's keys (the blocks batched again).

Every (query, key) pair below the diagonal lies in exactly one piece. The pieces are merged
with their log-sum-exps in fp32. Given the ``(B, S, H, D)`` memory layout that
``x.view(b, s, h, d).transpose(1, 2)`` produces, every block batch is a free view; other
layouts are copied into it once. The backward calls the kernel's backward once per piece with
the final output and log-sum-exp (from which the kernel gets each piece's exact gradients)
and adds the pieces' ``dq``/``dk``/``dv`` up (in fp32 for half-precision inputs).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

__all__ = [
    "causal_block_size",
    "causal_flash_attention",
    "causal_flash_backward",
    "causal_flash_forward",
    "tiled_causal_block",
    "tiled_causal_supported",
]

logger = logging.getLogger(__name__)

_FWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)

MAX_BLOCK = 128
"""The preferred diagonal block: the largest ``blk <= MAX_BLOCK`` with ``S = blk * 2**L``
(the fastest block size measured on CPU: colossal-kernels' CHANGELOG)."""

MIN_LEN = 512
"""Shorter sequences gain too little to pay for the extra kernel calls (callers use SDPA)."""

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def causal_block_size(seq_len: int, max_block: int = MAX_BLOCK) -> int | None:
    """The diagonal block size for ``seq_len`` tokens, or None if it does not tile.

    Args:
        seq_len: The (query and key) sequence length ``S``.
        max_block: The largest block wanted (a larger one, up to 256, is taken only when
            ``S`` has no suitable smaller one).

    Returns:
        ``blk`` with ``S = blk * 2**L``, ``L >= 1`` and ``64 <= blk <= 256``: the largest
        such ``blk <= max_block``, else the smallest above it; None if there is none.
    """
    if seq_len < 128:
        return None
    blk = seq_len
    while blk % 2 == 0 and blk > max_block:
        blk //= 2
    if blk < 64 or blk > 256 or blk == seq_len:
        return None
    return blk


def tiled_causal_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       dropout_p: float = 0.0, min_len: int = MIN_LEN,
                       max_block: int = MAX_BLOCK) -> int | None:
    """The diagonal block :func:`causal_flash_attention` would use, None if it cannot.

    Args:
        q: ``[B, H, S, D]`` queries.
        k: ``[B, Hk, S, D]`` keys.
        v: ``[B, Hk, S, D]`` values.
        dropout_p: Attention dropout (only 0 is supported).
        min_len: Shortest sequence worth tiling.
        max_block: Passed to :func:`causal_block_size`.

    Returns:
        The block size for CPU fp32/bf16/fp16 tensors of one dtype, no dropout, equal query
        and key lengths ``S >= min_len`` that tile (:func:`causal_block_size`), ``Hk``
        dividing ``H`` and one head size, when PyTorch has the CPU flash kernels; else None.
    """
    if _FWD is None or _BWD is None or dropout_p != 0.0:
        return None
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return None
    if not all(t.device.type == "cpu" and t.dtype == q.dtype for t in (q, k, v)):
        return None
    if q.dtype not in _DTYPES:
        return None
    b, h, s, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[2] != s or k.shape[3] != d:
        return None
    if k.shape[1] == 0 or h % k.shape[1] or s < min_len:
        return None
    return causal_block_size(s, max_block)


def tiled_causal_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           dropout_p: float = 0.0, min_len: int = MIN_LEN) -> bool:
    """Whether :func:`causal_flash_attention` takes these inputs (else use SDPA unchanged).

    See :func:`tiled_causal_block` for the arguments and conditions.
    """
    return tiled_causal_block(q, k, v, dropout_p, min_len) is not None


def _bshd(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, H, S, D]`` in a memory layout whose block batches are views."""
    if x.stride(-1) == 1 and (x.transpose(1, 2).is_contiguous()
                              or (x.shape[0] == 1 and x.is_contiguous())):
        return x
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _new_bshd(b: int, h: int, s: int, d: int, like: torch.Tensor,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    return like.new_empty(b, s, h, d, dtype=dtype or like.dtype).transpose(1, 2)


def _blocks(x: torch.Tensor, w: int, which: int | None) -> torch.Tensor:
    """The ``w``-blocks of ``x`` (``[B, H, S, ...]``) as a batch ``[B * G, H, w, ...]``.

    ``which`` None: every block (``G = S / w``); 0 or 1: the even or the odd blocks
    (``G = S / 2w``). A view for the layouts :func:`_bshd` returns.
    """
    b, h, s = x.shape[:3]
    if which is None:
        y = x.unflatten(2, (s // w, w))
    else:
        y = x.unflatten(2, (s // (2 * w), 2, w)).select(3, which)
    y = y.transpose(1, 2)  # [B, G, H, w, ...]
    return y.reshape(-1, *y.shape[2:])


def _levels(s: int, blk: int) -> list[int]:
    """The off-diagonal widths ``S/2, S/4, ..., blk``."""
    out, w = [], s // 2
    while w >= blk:
        out.append(w)
        w //= 2
    return out


def _block(q: torch.Tensor, block: int | None) -> int:
    s = q.shape[2]
    blk = causal_block_size(s) if block is None else block
    if blk is None or s % blk or (s // blk) & (s // blk - 1) or s // blk < 2:
        raise ValueError(f"sequence length {s} does not tile into diagonal blocks of "
                         f"{blk} (need S = block * 2**L, L >= 1); check "
                         "tiled_causal_supported() first and use SDPA otherwise")
    return blk


def causal_flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                         block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention output and log-sum-exp, computed in tiles (no autograd).

    The conventions of ``aten._scaled_dot_product_flash_attention_for_cpu(..., is_causal=True)``.

    Args:
        q: ``[B, H, S, D]`` queries.
        k: ``[B, Hk, S, D]`` keys (``Hk`` divides ``H``; query head ``i`` reads key/value
            head ``i // (H / Hk)``).
        v: ``[B, Hk, S, D]`` values.
        scale: Score scale.
        block: Diagonal block size (default :func:`causal_block_size`).

    Returns:
        ``(out [B, H, S, D]`` in ``q``'s dtype, ``lse [B, H, S]`` fp32), both with
        ``(B, S, H)``-major memory.

    Raises:
        ValueError: ``S`` does not tile into ``block``.
    """
    assert _FWD is not None, "no aten flash attention for CPU (see tiled_causal_supported)"
    blk = _block(q, block)
    b, h, s, d = q.shape
    q, k, v = _bshd(q), _bshd(k), _bshd(v)
    half = q.dtype != torch.float32
    acc = _new_bshd(b, h, s, d, q, torch.float32)
    lse = q.new_empty(b, s, h, dtype=torch.float32).transpose(1, 2)
    o, l_ = _FWD(_blocks(q, blk, None), _blocks(k, blk, None), _blocks(v, blk, None), 0.0,
                 True, scale=scale)
    _blocks(acc, blk, None).copy_(o)
    _blocks(lse, blk, None).copy_(l_)
    for w in _levels(s, blk):
        o, l_ = _FWD(_blocks(q, w, 1), _blocks(k, w, 0), _blocks(v, w, 0), 0.0, False,
                     scale=scale)
        acc_w, lse_w = _blocks(acc, w, 1), _blocks(lse, w, 1)
        new = torch.logaddexp(lse_w, l_)
        keep = torch.sub(lse_w, new).exp_().unsqueeze(-1)
        add = torch.sub(l_, new).exp_().unsqueeze(-1)
        acc_w.mul_(keep).addcmul_(o.float() if half else o, add)
        lse_w.copy_(new)
    return (acc.to(q.dtype) if half else acc), lse


def causal_flash_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                          v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, scale: float,
                          block: int | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of causal attention, computed in tiles (no autograd).

    The conventions of ``aten._scaled_dot_product_flash_attention_for_cpu_backward(...,
    is_causal=True)``: ``out`` and ``lse`` are the forward's (whole-sequence) results.

    Args:
        dout: ``[B, H, S, D]`` gradient of the output.
        q: ``[B, H, S, D]`` queries.
        k: ``[B, Hk, S, D]`` keys.
        v: ``[B, Hk, S, D]`` values.
        out: ``[B, H, S, D]`` the forward output.
        lse: ``[B, H, S]`` the forward log-sum-exp (fp32).
        scale: Score scale.
        block: Diagonal block size (default :func:`causal_block_size`).

    Returns:
        ``(dq, dk, dv)`` shaped and typed like ``q``, ``k``, ``v``.

    Raises:
        ValueError: ``S`` does not tile into ``block``.
    """
    assert _BWD is not None, "no aten flash attention for CPU (see tiled_causal_supported)"
    blk = _block(q, block)
    b, h, s, d = q.shape
    hk = k.shape[1]
    dout, q, k, v, out = (_bshd(t) for t in (dout, q, k, v, out))
    lse = lse.float()
    if not lse.transpose(1, 2).is_contiguous():
        lse = lse.transpose(1, 2).contiguous().transpose(1, 2)
    acc_t = torch.float32
    dq = _new_bshd(b, h, s, d, q, acc_t)
    dk = _new_bshd(b, hk, s, d, k, acc_t)
    dv = _new_bshd(b, hk, s, d, v, acc_t)
    g = _BWD(_blocks(dout, blk, None), _blocks(q, blk, None), _blocks(k, blk, None),
             _blocks(v, blk, None), _blocks(out, blk, None), _blocks(lse, blk, None), 0.0, True,
             scale=scale)
    for grad, piece in zip((dq, dk, dv), g, strict=True):
        _blocks(grad, blk, None).copy_(piece)
    for w in _levels(s, blk):
        g = _BWD(_blocks(dout, w, 1), _blocks(q, w, 1), _blocks(k, w, 0), _blocks(v, w, 0),
                 _blocks(out, w, 1), _blocks(lse, w, 1), 0.0, False, scale=scale)
        _blocks(dq, w, 1).add_(g[0])
        _blocks(dk, w, 0).add_(g[1])
        _blocks(dv, w, 0).add_(g[2])
    if q.dtype != acc_t:
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    return dq, dk, dv


class _CausalFlash(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                block: int | None) -> torch.Tensor:
        out, lse = causal_flash_forward(q, k, v, scale, block)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.block = scale, block
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = causal_flash_backward(dout, q, k, v, out, lse, ctx.scale, ctx.block)
        return dq, dk, dv, None, None


def causal_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           scale: float | None = None, block: int | None = None
                           ) -> torch.Tensor:
    """Differentiable causal attention through the tiled CPU flash kernel.

    Args:
        q: ``[B, H, S, D]`` queries.
        k: ``[B, Hk, S, D]`` keys (``Hk`` divides ``H``).
        v: ``[B, Hk, S, D]`` values.
        scale: Score scale (default ``1/sqrt(D)``).
        block: Diagonal block size (default :func:`causal_block_size`).

    Returns:
        ``[B, H, S, D]`` in ``q``'s dtype (``(B, S, H, D)`` memory).

    Raises:
        ValueError: Inputs :func:`tiled_causal_supported` refuses (ignoring ``min_len``).
    """
    if not tiled_causal_supported(q, k, v, 0.0, min_len=0):
        raise ValueError(
            f"tiled causal flash attention cannot take q {tuple(q.shape)} {q.dtype} "
            f"{q.device}, k {tuple(k.shape)}, v {tuple(v.shape)}: it needs CPU fp32/bf16/fp16 "
            "tensors, equal query/key lengths S = block * 2**L and one head size; check "
            "tiled_causal_supported() and use SDPA otherwise"
        )
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _CausalFlash.apply(q, k, v, scale, block)
