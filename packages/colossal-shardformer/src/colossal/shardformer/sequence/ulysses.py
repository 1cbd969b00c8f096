"""Ulysses (``all_to_all``) sequence-parallel attention.

Each rank of the sequence-parallel group holds the query, key and value of its own tokens for
every head. One all-to-all (q, k and v packed side by side in one buffer) trades that for all
tokens of ``1/P`` of the heads; the attention then runs locally over the whole sequence with
the full-length mask the model built, and one more all-to-all gives every rank its own tokens
back for every head. Each direction costs one packing copy per tensor on the way out and one
on the way back (the buffers are token-major so the received sequence needs no reordering).
Per layer and rank the forward exchanges q, k, v and the output: ``4 * s * h / P`` elements
with as many key/value heads as query heads (``(2 + 2 * Hk / Hq) * s * h / P`` with grouped-query
attention, whose key/value heads are exchanged as they are, never repeated first); the
backward exchanges the same amount again (each all-to-all's gradient is the reverse
all-to-all).

Layouts: when the ranks do not hold contiguous token ranges (``positions`` given), the
gathered sequence is put back into natural order before the attention and the output is cut
back to the gathered order after it, so masks (causal, padded, custom) need no translation.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

__all__ = ["seq_to_heads", "heads_to_seq", "ulysses_attention_forward"]

logger = logging.getLogger(__name__)


def _exchange(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """One all-to-all of ``x`` (``[P, ...]``, slice ``j`` goes to rank ``j``) over ``group``."""
    from colossal.core.comm import all_to_all

    x = x.contiguous()
    out = torch.empty_like(x)
    all_to_all(out, x, group=group)
    return out


def _seq_to_heads(x: torch.Tensor, group: ProcessGroup | None, size: int) -> torch.Tensor:
    b, h, s, d = x.shape
    parts = x.reshape(b, size, h // size, s, d).transpose(0, 1)  # [P, B, H/P, s, D]
    got = _exchange(parts, group)  # got[j]: rank j's tokens of this rank's heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * s, d)


def _heads_to_seq(x: torch.Tensor, group: ProcessGroup | None, size: int) -> torch.Tensor:
    b, h, s, d = x.shape
    parts = x.reshape(b, h, size, s // size, d).permute(2, 0, 1, 3, 4)  # [P, B, H/P, s/P, D]
    got = _exchange(parts, group)  # got[j]: rank j's heads of this rank's tokens
    return got.transpose(0, 1).reshape(b, size * h, s // size, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        return _seq_to_heads(x, group, size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _heads_to_seq(grad, ctx.group, ctx.size), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        return _heads_to_seq(x, group, size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _seq_to_heads(grad, ctx.group, ctx.size), None, None


class _ExchangeQKV(torch.autograd.Function):
    """q, k, v of this rank's tokens -> all tokens of this rank's heads, in ONE all-to-all.

    The send buffer is ``[P, s/P, B, F]`` with ``F = (Hq + Hk) / P * D + Hk / P * Dv``: slice
    ``j`` holds rank ``j``'s heads of q, k and v side by side, written with one strided copy
    per tensor. Token-major (``s`` before ``B``) so the received ``[P, s/P, B, F]`` is already
    the gathered sequence ``[s, B, F]`` and q, k, v are views of it (for any batch size).
    With ``natural`` (a non-contiguous layout) one ``index_select`` puts all three in natural
    token order. The backward packs the three gradients (scattering them back into gathered
    order with ``index_copy_``) and runs the reverse exchange, again one call.
    """

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        group: ProcessGroup | None,
        size: int,
        natural: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, hq, sl, d = q.shape
        hk, dv = k.shape[1], v.shape[3]
        widths = (hq // size * d, hk // size * d, hk // size * dv)
        shapes = ((hq // size, d), (hk // size, d), (hk // size, dv))
        send = q.new_empty(size, sl, b, sum(widths))
        offset = 0
        for t, w, (h, dd) in zip((q, k, v), widths, shapes, strict=True):
            dst = send[..., offset : offset + w].unflatten(-1, (h, dd))  # [P, s/P, B, h, dd]
            dst.copy_(t.unflatten(1, (size, h)).permute(1, 3, 0, 2, 4))
            offset += w
        got = _exchange(send, group).view(size * sl, b, -1)  # [s, B, F], gathered order
        if natural is not None:
            got = got.index_select(0, natural)
        ctx.group, ctx.size, ctx.widths, ctx.shapes = group, size, widths, shapes
        ctx.natural = natural
        outs = []
        offset = 0
        for w, (h, dd) in zip(widths, shapes, strict=True):
            part = got[..., offset : offset + w].unflatten(-1, (h, dd))  # [s, B, h, dd]
            outs.append(part.permute(1, 2, 0, 3))  # [B, h, s, dd]
            offset += w
        return outs[0], outs[1], outs[2]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        size, widths, shapes, natural = ctx.size, ctx.widths, ctx.shapes, ctx.natural
        b, _, s, _ = grads[0].shape
        sl = s // size
        send = grads[0].new_empty(s, b, sum(widths))  # gathered order
        offset = 0
        for g, w, (h, dd) in zip(grads, widths, shapes, strict=True):
            dst = send[..., offset : offset + w].unflatten(-1, (h, dd))  # [s, B, h, dd]
            src = g.permute(2, 0, 1, 3)  # [s, B, h, dd], natural order
            if natural is None:
                dst.copy_(src)
            else:
                dst.index_copy_(0, natural, src)
            offset += w
        got = _exchange(send.view(size, sl, b, -1), ctx.group)  # [P, s/P, B, F]
        results = []
        offset = 0
        for w, (h, dd) in zip(widths, shapes, strict=True):
            full = send.new_empty(b, sl, size * h, dd)
            src = got[..., offset : offset + w].unflatten(-1, (h, dd))  # [P, s/P, B, h, dd]
            full.unflatten(2, (size, h)).copy_(src.permute(2, 1, 0, 3, 4))
            results.append(full.transpose(1, 2))  # [B, H, s/P, dd]
            offset += w
        return results[0], results[1], results[2], None, None, None


class _ExchangeOut(torch.autograd.Function):
    """The attention output ``[B, s, H/P, Dv]`` -> ``[B, s/P, H, Dv]``, one all-to-all.

    The send buffer ``[s, B, F] = [P, s/P, B, F]`` is one copy of the output (an
    ``index_select`` into gathered order with ``positions``); the received slices are written
    once into the returned contiguous ``[B, s/P, H, Dv]``.
    """

    @staticmethod
    def forward(
        ctx: Any,
        out: torch.Tensor,
        group: ProcessGroup | None,
        size: int,
        positions: torch.Tensor | None,
    ) -> torch.Tensor:
        b, s, h, dv = out.shape
        ctx.group, ctx.size, ctx.natural = group, size, None
        src = out.transpose(0, 1)  # [s, B, h, Dv]
        if positions is None:
            send = src.contiguous()
        else:
            send = src.index_select(0, positions)
            ctx.natural = torch.argsort(positions)
        got = _exchange(send.view(size, s // size, b, h * dv), group)  # [P, s/P, B, F]
        result = out.new_empty(b, s // size, size * h, dv)
        result.unflatten(2, (size, h)).copy_(got.unflatten(-1, (h, dv)).permute(2, 1, 0, 3, 4))
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        size = ctx.size
        b, sl, hh, dv = grad.shape
        h = hh // size
        send = grad.new_empty(size, sl, b, h, dv)
        send.copy_(grad.unflatten(2, (size, h)).permute(2, 1, 0, 3, 4))
        got = _exchange(send, ctx.group).view(size * sl, b, h, dv)  # gathered order
        if ctx.natural is not None:
            got = got.index_select(0, ctx.natural)
        return got.transpose(0, 1), None, None, None


def seq_to_heads(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """``[B, H, s/P, D]`` (this rank's tokens, all heads) -> ``[B, H/P, s, D]`` (differentiable).

    The gathered sequence is the ranks' token slices in rank order; this rank keeps the heads
    ``[r*H/P, (r+1)*H/P)``.

    Raises:
        ValueError: ``H`` is not divisible by the group size.
    """
    size = dist.get_world_size(group)
    if x.shape[1] % size:
        raise ValueError(
            f"Ulysses attention splits {x.shape[1]} heads over {size} sequence-parallel ranks; "
            "use a sequence-parallel size that divides the (tensor-parallel local) head count"
        )
    if size == 1:
        return x
    return _SeqToHeads.apply(x, group, size)


def heads_to_seq(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """The inverse of :func:`seq_to_heads`: ``[B, H/P, s, D]`` -> ``[B, H, s/P, D]``."""
    size = dist.get_world_size(group)
    if size == 1:
        return x
    return _HeadsToSeq.apply(x, group, size)


def ulysses_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    *,
    group: ProcessGroup | None = None,
    positions: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Transformers' attention-function signature, over Ulysses sequence parallelism.

    Args:
        module: The calling attention module (its ``is_causal`` is read).
        query: ``[B, Hq, s/P, D]``, this rank's tokens (after rotary).
        key: ``[B, Hk, s/P, D]``.
        value: ``[B, Hk, s/P, Dv]``.
        attention_mask: The full-length mask the model built: None (causal when the module is
            causal), a ``[B, s]`` padding mask or a 4-D bool / additive float mask.
        dropout: Attention dropout probability.
        scaling: Score scale (default ``1/sqrt(D)``).
        is_causal: Overrides ``module.is_causal`` when given.
        group: The sequence-parallel process group (None: the whole job).
        positions: The global positions of the gathered tokens (the ranks' tokens in rank
            order), or None when the ranks hold contiguous ranges in rank order.
        **kwargs: Other model arguments (passed on to the local attention).

    Returns:
        ``(output [B, s/P, Hq, Dv], None)``.

    Raises:
        ValueError: A head count not divisible by the group size.
        TypeError: Query, key and value of different dtypes.
    """
    from colossal.shardformer.attention import colossal_attention_forward

    group = dist.group.WORLD if group is None else group
    size = dist.get_world_size(group)
    for name, t in (("query", query), ("key", key)):
        if t.shape[1] % size:
            raise ValueError(
                f"Ulysses attention splits {t.shape[1]} heads over {size} sequence-parallel "
                f"ranks ({name}); use a sequence-parallel size that divides the "
                "(tensor-parallel local) head count"
            )
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    if attention_mask is not None and attention_mask.dim() == 2 and not causal:
        # A key padding mask, as SDPA applies it (the kernels' padded kind would also zero
        # the padded queries' outputs).
        attention_mask = attention_mask.bool()[:, None, None, :]
    if positions is not None:
        positions = positions.to(query.device)
    if not query.dtype == key.dtype == value.dtype:
        raise TypeError(
            f"Ulysses attention exchanges query, key and value in one buffer and needs one "
            f"dtype, got {query.dtype}, {key.dtype}, {value.dtype}; cast them to one dtype"
        )
    q, k, v = query, key, value
    if size > 1:
        natural = None if positions is None else torch.argsort(positions)
        q, k, v = _ExchangeQKV.apply(query, key, value, group, size, natural)
    out, _ = colossal_attention_forward(
        module,
        q,
        k,
        v,
        attention_mask,
        dropout=dropout,
        scaling=scaling,
        is_causal=causal,
        **kwargs,
    )  # [B, s, Hq/P, Dv]
    if size > 1:
        out = _ExchangeOut.apply(out, group, size, positions)
    return out, None
