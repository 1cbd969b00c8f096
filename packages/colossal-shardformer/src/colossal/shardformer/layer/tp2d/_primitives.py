"""Differentiable communication primitives of 2D tensor parallelism.

Every collective goes through :mod:`colossal.core.comm` (the tracker counts it). ``R`` is
this rank's row group (ranks ``(i, *)``), ``C`` its column group (ranks ``(*, j)``), ``q`` the
grid's side:

==========================  ====================================  ============================
primitive                   forward                               backward
==========================  ====================================  ============================
``Linear2DFn``              SUMMA ``X W^T``: q broadcasts of X    q broadcasts of W (C), q
                            (R), q of W (C)                       reduces of dX (R); q
                                                                  broadcasts of X (R), q
                                                                  reduces of dW (C)
``VocabClassifier2DFn``     SUMMA ``X W^T`` with W in place: q    q broadcasts of dY (R), q
                            broadcasts of W (C), q reduces of Y   of W (C), q reduces of dW
                            (R)                                   (C)
``gather_params``           one all-gather (C) of all tensors     one reduce-scatter (C)
``VocabEmbedding2DFn``      lookup; reduce-scatter of rows (C)    all-gather of rows (C)
``Normalize2DFn``           all-reduce row sums, then squared     one all-reduce of two row
                            deviations (R)                        sums (R)
``reduce_forward``          all-reduce                            identity
``reduce_grad``             identity                              all-reduce
``batch_mean``              all-reduce of (sum, count)            gradient / count
``split_blocks`` /          keep / gather this rank's rows        the other one
``gather_blocks``           and columns
==========================  ====================================  ============================

A grid of one rank communicates nothing. Tensors given to a reduce-scatter are fresh (the
gloo reduce-scatter may consume its input).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the usual alias
from torch.distributed import ProcessGroup

from colossal.core.comm import all_gather, all_reduce, reduce_scatter
from colossal.shardformer.layer._utils import group_size
from colossal.shardformer.layer.tp2d._grid import Grid2D
from colossal.shardformer.layer.tp2d._summa import (
    BlockStream,
    Reductions,
    summa_ab,
    summa_abt,
    summa_atb,
)

__all__ = [
    "Linear2DFn",
    "Normalize2DFn",
    "VocabClassifier2DFn",
    "VocabEmbedding2DFn",
    "batch_mean",
    "gather_along",
    "gather_blocks",
    "gather_params",
    "reduce_forward",
    "reduce_grad",
    "reduce_scatter_along",
    "split_blocks",
]


# ---- plain (non-differentiable) collectives ------------------------------------------------


def gather_along(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """Every rank's ``x`` of ``group`` concatenated along ``dim`` (in group order)."""
    size = group_size(group)
    if size == 1:
        return x
    x = x.contiguous()
    buf = x.new_empty((size, *x.shape))
    all_gather(buf, x, group=group)
    dim %= x.dim()
    shape = (*x.shape[:dim], size * x.shape[dim], *x.shape[dim + 1 :])
    return buf.reshape(shape) if dim == 0 else buf.movedim(0, dim).reshape(shape)


def _pieces(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``x`` cut into ``size`` equal blocks along ``dim``, stacked first: ``(size, ...)``."""
    n = x.shape[dim]
    if n % size:
        raise ValueError(
            f"2D tensor parallel: dim {dim} of a tensor of shape {tuple(x.shape)} is not "
            f"divisible by {size}; pad it to a multiple of {size}"
        )
    split = x.reshape(*x.shape[:dim], size, n // size, *x.shape[dim + 1 :])
    return split.movedim(dim, 0)


def reduce_scatter_along(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """Sum ``x`` over ``group`` and keep this rank's block of ``dim`` (consumes ``x``).

    Raises:
        ValueError: ``x.shape[dim]`` is not divisible by the group size.
    """
    size = group_size(group)
    if size == 1:
        return x
    chunks = _pieces(x, dim % x.dim(), size).contiguous()
    out = x.new_empty(chunks.shape[1:])
    reduce_scatter(out, chunks, group=group)
    return out


def _block(x: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
    """Block ``index`` of ``parts`` equal blocks of ``x`` along ``dim``."""
    n = x.shape[dim]
    if n % parts:
        raise ValueError(
            f"2D tensor parallel: dim {dim % x.dim()} of a tensor of shape {tuple(x.shape)} "
            f"is not divisible by q={parts}; pad it to a multiple of {parts}"
        )
    step = n // parts
    return x.narrow(dim, index * step, step)


def _rows_2d(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``(rows, features)``: every leading dim flattened into rows."""
    return t.reshape(-1, t.shape[-1])


# ---- the SUMMA products --------------------------------------------------------------------


class Linear2DFn(torch.autograd.Function):
    """``Y = X W^T`` by SUMMA, ``W`` in torch's ``(out, in)`` layout.

    ``x``: ``X_ij``, ``(n/q, ..., in/q)``; ``weight``: ``W[out block j, in block i]``,
    ``(out/q, in/q)`` (ColossalAI's ``(in/q, out/q)`` block ``A_ij`` of ``A = W^T``).
    Returns ``Y_ij``, ``(n/q, ..., out/q)``. Only the local blocks are saved: the backward
    broadcasts again what it needs (the seed page's ``O(1/q^2)`` activation memory).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, grid: Grid2D) -> torch.Tensor:
        ctx.grid = grid
        ctx.save_for_backward(x, weight)
        return summa_ab(x, weight, grid, lambda xb, wb: torch.matmul(xb, wb.t()))

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grid: Grid2D = ctx.grid
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:  # dX_it = sum_j dY_ij W[out j, in t]
            dx = summa_abt(dy, weight, grid, torch.matmul)
        if ctx.needs_input_grad[1]:  # dW[out j, in t] = sum_i dY_ij^T X_it
            dw = summa_atb(x, dy, grid, lambda xb, g: torch.matmul(_rows_2d(g).t(), _rows_2d(xb)))
        return dx, dw, None


class VocabClassifier2DFn(torch.autograd.Function):
    """``Y = X W^T`` by SUMMA with ``W`` blocked like the activations (tied to an embedding).

    ``x``: ``X_ij``, ``(n/q, ..., in/q)``; ``weight``: ``W[class block i, in block j]``,
    ``(C/q, in/q)`` (a :class:`~.embedding.VocabParallelEmbedding2D`'s layout). Returns the
    logits ``Y_ij``, ``(n/q, ..., C/q)``: rows block ``i``, classes block ``j``.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, grid: Grid2D) -> torch.Tensor:
        ctx.grid = grid
        ctx.save_for_backward(x, weight)
        return summa_abt(x, weight, grid, lambda xb, wb: torch.matmul(xb, wb.t()))

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grid: Grid2D = ctx.grid
        dy = dy.contiguous()
        want_dx, want_dw = ctx.needs_input_grad[:2]
        dx: torch.Tensor | None = None
        if grid.q == 1:
            dx = torch.matmul(dy, weight) if want_dx else None
            dw = torch.matmul(_rows_2d(dy).t(), _rows_2d(x)) if want_dw else None
            return dx, dw, None
        # Both gradients use dY_it (broadcast along the row) at step t: one stream for both.
        # dX_ij = sum_t dY_it W[class t, in j];  dW[class t, in j] = sum_i dY_it^T X_ij.
        grads = BlockStream(dy, grid.row_group, grid.row_ranks)
        weights = BlockStream(weight, grid.col_group, grid.col_ranks) if want_dx else None
        sums = Reductions(grid.col_group, grid.col_ranks) if want_dw else None
        for t in range(grid.q):
            for step in (t, t + 1):
                grads.start(step)
                if weights is not None:
                    weights.start(step)
            g = grads.take(t)
            if weights is not None:
                part = torch.matmul(g, weights.take(t))
                dx = part if dx is None else dx.add_(part)
            if sums is not None:
                sums.add(t, torch.matmul(_rows_2d(g).t(), _rows_2d(x)))
        dw = sums.finish() if sums is not None else None
        return dx, dw, None


# ---- parameters gathered along the column --------------------------------------------------


class _GatherParams(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, group: ProcessGroup, dims: tuple[int, ...], *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        size = group_size(group)
        ctx.group, ctx.dims, ctx.shapes = group, dims, [t.shape for t in tensors]
        flat = torch.cat([t.reshape(-1) for t in tensors])
        buf = flat.new_empty((size, flat.numel()))
        all_gather(buf, flat, group=group)
        out = []
        for piece, t, dim in zip(
            buf.split([t.numel() for t in tensors], dim=1), tensors, dims, strict=True
        ):
            d = dim % t.dim()
            stacked = piece.reshape(size, *t.shape).movedim(0, d)
            out.append(stacked.reshape(*t.shape[:d], size * t.shape[d], *t.shape[d + 1 :]))
        return tuple(out)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        size = group_size(ctx.group)
        parts = [
            _pieces(g, dim % g.dim(), size).reshape(size, -1)
            for g, dim in zip(grads, ctx.dims, strict=True)
        ]
        flat = torch.cat(parts, dim=1).contiguous()
        out = flat.new_empty(flat.shape[1])
        reduce_scatter(out, flat, group=ctx.group)
        pieces = out.split([p.shape[1] for p in parts])
        return (
            None,
            None,
            *(p.view(shape) for p, shape in zip(pieces, ctx.shapes, strict=True)),
        )


def gather_params(
    tensors: Sequence[torch.Tensor], dims: Sequence[int], grid: Grid2D
) -> list[torch.Tensor]:
    """Each tensor concatenated over this rank's column along its ``dims`` entry.

    A parameter split ``q*q`` ways (block ``j`` along the row, then block ``i`` inside it)
    becomes block ``j`` whole, what the rank's columns of the activation need. One all-gather
    for all of ``tensors``; the backward sums the gradients over the column and keeps each
    rank's piece (one reduce-scatter).
    """
    if grid.q == 1:
        return list(tensors)
    return list(_GatherParams.apply(grid.col_group, tuple(dims), *tensors))


# ---- embeddings and normalization ----------------------------------------------------------


class VocabEmbedding2DFn(torch.autograd.Function):
    """Lookup in a vocabulary-parallel embedding.

    ``ids``: the whole batch ``(n, ...)``; ``weight``: ``(V/q, D/q)``, vocabulary block ``i``
    and columns block ``j``. Each rank of the column looks its vocabulary block up for every
    row; the reduce-scatter over the column sums the blocks and keeps rows block ``i``:
    ``(n/q, ..., D/q)``.
    """

    @staticmethod
    def forward(
        ctx: Any,
        ids: torch.Tensor,
        weight: torch.Tensor,
        grid: Grid2D,
        padding_idx: int | None,
    ) -> torch.Tensor:
        per = weight.shape[0]
        local = ids - grid.i * per
        outside = (local < 0) | (local >= per)
        local = local.masked_fill(outside, 0)
        out = F.embedding(local, weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        keep = ~outside if padding_idx is None else ~outside & (ids != padding_idx)
        ctx.grid, ctx.rows = grid, per
        ctx.save_for_backward(local, keep)
        return reduce_scatter_along(out, 0, grid.col_group)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        local, keep = ctx.saved_tensors
        grid: Grid2D = ctx.grid
        dy_all = gather_along(dy.contiguous(), 0, grid.col_group)
        dw = dy_all.new_zeros((ctx.rows, dy_all.shape[-1]))
        dw.index_add_(0, local[keep], dy_all[keep])
        return None, dw, None, None


class Normalize2DFn(torch.autograd.Function):
    """``(x - mean) / sqrt(var + eps)`` over a last dim split along the row group.

    ``x``: ``(..., h/q)``; the mean and the biased variance of the whole width come from two
    all-reduces of row sums over ``group`` (two passes: no cancellation for large means).
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, width: int, eps: float, group: ProcessGroup
    ) -> torch.Tensor:
        many = group_size(group) > 1
        total = x.sum(dim=-1, keepdim=True)
        if many:
            all_reduce(total, group=group)
        centred = x - total / width
        var = centred.square().sum(dim=-1, keepdim=True)
        if many:
            all_reduce(var, group=group)
        rstd = torch.rsqrt(var / width + eps)
        z = centred * rstd
        ctx.width, ctx.group = width, group
        ctx.save_for_backward(z, rstd)
        return z

    @staticmethod
    def backward(ctx: Any, dz: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        z, rstd = ctx.saved_tensors
        sums = torch.stack([dz.sum(dim=-1), (dz * z).sum(dim=-1)])
        if group_size(ctx.group) > 1:
            all_reduce(sums, group=ctx.group)
        mean_dz, mean_dzz = (sums / ctx.width).unsqueeze(-1)
        return rstd * (dz - mean_dz - z * mean_dzz), None, None, None


# ---- replicated tensors and batch reductions -----------------------------------------------


class _ReduceForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        out = x.contiguous().clone()
        all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _ReduceGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.contiguous().clone()
        all_reduce(out, group=ctx.group)
        return out, None


def reduce_forward(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """All-reduce (sum) of partial results over ``group``; identity backward."""
    if group_size(group) == 1:
        return x
    return _ReduceForward.apply(x, group)


def reduce_grad(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Identity forward; the gradient all-reduced over ``group`` backward.

    For a tensor every rank of ``group`` holds alike and uses on its own rows: the sum gives
    every copy the whole gradient.
    """
    if group_size(group) == 1:
        return x
    return _ReduceGrad.apply(x, group)


class _BatchMean(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, total: torch.Tensor, count: torch.Tensor, group: ProcessGroup
    ) -> torch.Tensor:
        both = torch.stack([total.detach().float(), count.float()])
        if group_size(group) > 1:
            all_reduce(both, group=group)
        ctx.count = both[1]
        return (both[0] / both[1]).to(total.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return (grad / ctx.count).to(grad.dtype), None, None


def batch_mean(total: torch.Tensor, count: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """``sum(total) / sum(count)`` over ``group`` (one all-reduce), the same on every rank.

    ``total`` is this rank's sum of per-row values and ``count`` its number of rows; the
    gradient reaches ``total`` as ``1 / count`` of the whole batch.
    """
    return _BatchMean.apply(total, count, group)


# ---- activations: this rank's rows and columns ---------------------------------------------


def _split(x: torch.Tensor, grid: Grid2D, rows: bool, cols: bool) -> torch.Tensor:
    if rows:
        x = _block(x, 0, grid.q, grid.i)
    if cols:
        x = _block(x, -1, grid.q, grid.j)
    return x.contiguous()


def _gather(x: torch.Tensor, grid: Grid2D, rows: bool, cols: bool) -> torch.Tensor:
    if cols:
        x = gather_along(x, -1, grid.row_group)
    if rows:
        x = gather_along(x, 0, grid.col_group)
    return x


class _SplitBlocks(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, grid: Grid2D, rows: bool, cols: bool) -> torch.Tensor:
        ctx.args = (grid, rows, cols)
        return _split(x, grid, rows, cols)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _gather(grad.contiguous(), *ctx.args), None, None, None


class _GatherBlocks(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, grid: Grid2D, rows: bool, cols: bool) -> torch.Tensor:
        ctx.args = (grid, rows, cols)
        return _gather(x, grid, rows, cols)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _split(grad, *ctx.args), None, None, None


def split_blocks(x: torch.Tensor, grid: Grid2D, rows: bool, cols: bool) -> torch.Tensor:
    """This rank's rows (block ``i`` of dim 0) and/or columns (block ``j`` of the last dim).

    Differentiable: the backward gathers the gradient of the whole tensor on every rank.

    Raises:
        ValueError: A split dim is not divisible by ``q``.
    """
    if grid.q == 1 or not (rows or cols):
        return x
    if not x.requires_grad:
        return _split(x, grid, rows, cols)
    return _SplitBlocks.apply(x, grid, rows, cols)


def gather_blocks(x: torch.Tensor, grid: Grid2D, rows: bool, cols: bool) -> torch.Tensor:
    """The whole tensor from every rank's blocks (inverse of :func:`split_blocks`).

    Differentiable: the backward keeps this rank's block of the gradient.
    """
    if grid.q == 1 or not (rows or cols):
        return x
    return _GatherBlocks.apply(x, grid, rows, cols)
