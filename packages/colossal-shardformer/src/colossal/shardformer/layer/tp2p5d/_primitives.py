"""Differentiable communication primitives of 2.5D (Tesseract) tensor parallelism.

Every collective goes through :mod:`colossal.core.comm`, so
:class:`~colossal.core.CommTracker` counts it. ``R`` is this rank's row group (ranks
``(k, i, *)``), ``C`` its column group (``(k, *, j)``), ``D`` its depth group (``(*, i, j)``):

=============================  =================================  ===============================
primitive                      forward                            backward
=============================  =================================  ===============================
``Linear2p5DFn`` (``X A``)     all-gather X (R), A (C); matmul    all-gather A (C), reduce-scatter
                                                                  dX (R); all-gather X (R),
                                                                  reduce-scatter dA (C),
                                                                  all-reduce dA (D)
``Classifier2p5DFn``           all-gather W (C); matmul;          all-gather dY (R), W (C);
(``X W^T``)                    reduce-scatter Y (R)               reduce-scatter dW (C),
                                                                  all-reduce dW (D)
``VocabEmbedding2p5DFn``       lookup of this vocabulary block;   all-gather dY (C);
                               reduce-scatter the rows (C)        all-reduce dW (D)
``Normalize2p5DFn``            all-reduce row sums, then squared  one all-reduce of two row sums
                               deviations (R)                     (R)
``reduce_grad``                identity                           all-reduce
``reduce_forward``             all-reduce                         identity
``batch_mean``                 all-reduce of (sum, count)         gradient / count
``split_rows_cols`` /          keep / gather this rank's rows     the other one
``gather_rows_cols``           and columns
=============================  =================================  ===============================

SUMMA's ``q`` broadcasts of a row's (or a column's) blocks are, in all, one all-gather of
them: the same bytes per rank and ``q - 1`` ring steps, in one call instead of ``q``. The
products re-gather their operands in the backward rather than keep the gathered copies, so a
rank holds ``1/(d q^2)`` of each activation between layers, as the seed page's table says;
each matmul of the forward and backward then moves one activation-sized and one weight-sized
collective: the seed's ``3 (q - 1) (d + 1) / (d q)`` bandwidth. The weight gradient's
all-reduce over the depth (the weight is replicated there) is not in the seed's table
(ColossalAI ran it with the data-parallel gradient sync); here the layer runs it.

A group of one rank communicates nothing. Inputs of the reduce-scatters are fresh tensors
(matmul and lookup results): the gloo reduce-scatter consumes its input.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the usual alias
from torch.distributed import ProcessGroup

from colossal.core.comm import all_gather, all_reduce, reduce_scatter
from colossal.shardformer.layer._utils import group_size
from colossal.shardformer.layer.tp2p5d._grid import Grid2p5D

__all__ = [
    "Classifier2p5DFn",
    "Linear2p5DFn",
    "Normalize2p5DFn",
    "VocabEmbedding2p5DFn",
    "batch_mean",
    "gather_along",
    "gather_rows_cols",
    "reduce_forward",
    "reduce_grad",
    "reduce_scatter_along",
    "split_rows_cols",
]


# ---- plain (non-differentiable) collectives ------------------------------------------------


def gather_along(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """Every rank's ``x`` of ``group`` concatenated along ``dim`` (rank order)."""
    size = group_size(group)
    if size == 1:
        return x
    x = x.contiguous()
    buf = x.new_empty((size, *x.shape))
    all_gather(buf, x, group=group)
    dim %= x.dim()
    shape = (*x.shape[:dim], size * x.shape[dim], *x.shape[dim + 1 :])
    return buf.reshape(shape) if dim == 0 else buf.movedim(0, dim).reshape(shape)


def _block(x: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
    """Block ``index`` of ``parts`` equal blocks of ``x`` along ``dim`` (a view)."""
    n = x.shape[dim]
    if n % parts:
        raise ValueError(
            f"2.5D tensor parallel: dim {dim % x.dim()} of a tensor of shape {tuple(x.shape)} "
            f"is not divisible by {parts}; pad it to a multiple of {parts}"
        )
    step = n // parts
    return x.narrow(dim, index * step, step)


def reduce_scatter_along(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """Sum ``x`` over ``group`` and keep this rank's block of ``dim`` (consumes ``x``).

    Raises:
        ValueError: ``x.shape[dim]`` is not divisible by the group size.
    """
    size = group_size(group)
    if size == 1:
        return x
    dim %= x.dim()
    n = x.shape[dim]
    if n % size:
        raise ValueError(
            f"2.5D tensor parallel: dim {dim} of a tensor of shape {tuple(x.shape)} is not "
            f"divisible by the group size {size}; pad it to a multiple of {size}"
        )
    split = x.reshape(*x.shape[:dim], size, n // size, *x.shape[dim + 1 :])
    chunks = split.movedim(dim, 0).contiguous()
    out = x.new_empty(chunks.shape[1:])
    reduce_scatter(out, chunks, group=group)
    return out


def _all_reduce_(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Sum ``x`` (a fresh contiguous tensor) over ``group`` in place."""
    if group_size(group) > 1:
        all_reduce(x, group=group)
    return x


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a matrix of its rows ``(-1, last dim)``."""
    return x.reshape(-1, x.shape[-1])


# ---- the products ------------------------------------------------------------------------------


class Linear2p5DFn(torch.autograd.Function):
    """``Y = X A`` of the Tesseract algorithm, with ``A = weight.T`` (torch's ``(out, in)``).

    ``x``: ``(n, ..., in/q)``, block ``(k*q + i, j)``; ``weight``: ``(out/q, in/q)``, rows
    block ``j`` and columns block ``i`` of the whole weight (``A_ij`` of the seed page).
    Rank ``(k, i, j)`` gathers its row's ``X_(k,i),*`` and its column's ``A_*j`` and returns
    ``Y_(k,i),j`` ``(n, ..., out/q)``: the input's layout.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, grid: Grid2p5D) -> torch.Tensor:
        x_row = gather_along(x, -1, grid.group("row"))
        w_col = gather_along(weight, 1, grid.group("col"))
        ctx.grid = grid
        ctx.save_for_backward(x, weight)
        return torch.matmul(x_row, w_col.t())

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grid: Grid2p5D = ctx.grid
        dy = dy.contiguous()
        dx = dw = None
        # Under autocast the forward multiplied in a lower precision: so does the backward
        # (autograd casts each returned gradient to its input's dtype).
        if ctx.needs_input_grad[0]:
            w_col = gather_along(weight, 1, grid.group("col")).to(dy.dtype)
            dx = reduce_scatter_along(torch.matmul(dy, w_col), -1, grid.group("row"))
        if ctx.needs_input_grad[1]:
            x_row = gather_along(x, -1, grid.group("row")).to(dy.dtype)
            dw_row = torch.matmul(_rows(dy).t(), _rows(x_row))
            dw = _all_reduce_(reduce_scatter_along(dw_row, 1, grid.group("col")), grid.group("dep"))
        return dx, dw, None


class Classifier2p5DFn(torch.autograd.Function):
    """``Y = X W^T`` with ``W`` laid out as the vocabulary-parallel embedding's.

    ``x``: ``(n, ..., in/q)``, block ``(k*q + i, j)``; ``weight``: ``(C/q, in/q)``, rows
    (classes) block ``i`` and columns block ``j``. Rank ``(k, i, j)`` gathers its column's
    ``W_*j``, multiplies, and the reduce-scatter over its row sums the ``q`` column blocks'
    products and keeps classes block ``j``: ``(n, ..., C/q)`` in the input's layout.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, grid: Grid2p5D) -> torch.Tensor:
        w_col = gather_along(weight, 0, grid.group("col"))
        ctx.grid = grid
        ctx.save_for_backward(x, weight)
        return reduce_scatter_along(torch.matmul(x, w_col.t()), -1, grid.group("row"))

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grid: Grid2p5D = ctx.grid
        dy_row = gather_along(dy.contiguous(), -1, grid.group("row"))
        dx = dw = None
        if ctx.needs_input_grad[0]:
            w_col = gather_along(weight, 0, grid.group("col")).to(dy_row.dtype)
            dx = torch.matmul(dy_row, w_col)
        if ctx.needs_input_grad[1]:
            dw_col = torch.matmul(_rows(dy_row).t(), _rows(x).to(dy_row.dtype))
            dw = _all_reduce_(reduce_scatter_along(dw_col, 0, grid.group("col")), grid.group("dep"))
        return dx, dw, None


class VocabEmbedding2p5DFn(torch.autograd.Function):
    """Lookup of a vocabulary-parallel embedding.

    ``ids``: ``(n*q, ...)``, the rows of this rank's layer ``k``; ``weight``: ``(V/q, D/q)``,
    vocabulary block ``i`` and columns block ``j``. Each rank of the column group looks up its
    vocabulary block; the reduce-scatter over the column sums the blocks and keeps this rank's
    rows: ``(n, ..., D/q)``, block ``(k*q + i, j)``.
    """

    @staticmethod
    def forward(
        ctx: Any,
        ids: torch.Tensor,
        weight: torch.Tensor,
        grid: Grid2p5D,
        padding_idx: int | None,
    ) -> torch.Tensor:
        per = weight.shape[0]
        local = ids - grid.i * per
        outside = (local < 0) | (local >= per)
        local = local.masked_fill(outside, 0)
        out = F.embedding(local, weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        keep = ~outside if padding_idx is None else ~outside & (ids != padding_idx)
        ctx.grid, ctx.shape = grid, tuple(weight.shape)
        ctx.save_for_backward(local, keep)
        return reduce_scatter_along(out, 0, grid.group("col"))

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        local, keep = ctx.saved_tensors
        grid: Grid2p5D = ctx.grid
        dy_col = gather_along(dy.contiguous(), 0, grid.group("col"))
        dw = dy_col.new_zeros(ctx.shape)
        dw.index_add_(0, local[keep], dy_col[keep])
        return None, _all_reduce_(dw, grid.group("dep")), None, None


class Normalize2p5DFn(torch.autograd.Function):
    """``(x - mean) / sqrt(var + eps)`` over a feature dim split along ``group``.

    ``x``: ``(..., h/q)``; the mean and the (biased) variance of the whole ``h`` come from
    two all-reduces of row sums (two passes: no cancellation for large means).
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, width: int, eps: float, group: ProcessGroup
    ) -> torch.Tensor:
        total = _all_reduce_(x.sum(dim=-1, keepdim=True), group)
        centred = x - total / width
        var = _all_reduce_(centred.square().sum(dim=-1, keepdim=True), group)
        rstd = torch.rsqrt(var / width + eps)
        z = centred * rstd
        ctx.width, ctx.group = width, group
        ctx.save_for_backward(z, rstd)
        return z

    @staticmethod
    def backward(ctx: Any, dz: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        z, rstd = ctx.saved_tensors
        sums = _all_reduce_(torch.stack([dz.sum(dim=-1), (dz * z).sum(dim=-1)]), ctx.group)
        mean_dz, mean_dzz = (sums / ctx.width).unsqueeze(-1)
        return rstd * (dz - mean_dz - z * mean_dzz), None, None, None


# ---- replicated tensors --------------------------------------------------------------------


class _ReduceGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce_(grad.contiguous().clone(), ctx.group), None


class _ReduceForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        return _all_reduce_(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def reduce_grad(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Identity forward; the gradient all-reduced over ``group`` backward.

    For a tensor every rank of ``group`` holds alike and uses on its own rows: the sum gives
    every copy the whole gradient.
    """
    if group_size(group) == 1:
        return x
    return _ReduceGrad.apply(x, group)


def reduce_forward(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """All-reduce (sum) of partial results over ``group``; identity backward."""
    if group_size(group) == 1:
        return x
    return _ReduceForward.apply(x, group)


class _BatchMean(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, total: torch.Tensor, count: torch.Tensor, group: ProcessGroup
    ) -> torch.Tensor:
        both = _all_reduce_(torch.stack([total.detach().float(), count.float()]), group)
        ctx.count = both[1]
        return (both[0] / both[1]).to(total.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return (grad / ctx.count).to(grad.dtype), None, None


def batch_mean(total: torch.Tensor, count: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """The mean over ``group``'s rows: ``sum(total) / sum(count)`` (one all-reduce).

    ``total`` is this rank's scalar sum of per-row values, ``count`` its number of rows; the
    result is the same on every rank, and its gradient reaches ``total`` as ``1 / count``.
    """
    return _BatchMean.apply(total, count, group)


# ---- activations: this rank's rows and columns ---------------------------------------------


def _split(x: torch.Tensor, grid: Grid2p5D, rows: bool, cols: bool) -> torch.Tensor:
    if rows:
        x = _block(x, 0, grid.row_blocks, grid.row_block)
    if cols:
        x = _block(x, -1, grid.q, grid.j)
    return x.contiguous()


def _gather(x: torch.Tensor, grid: Grid2p5D, rows: bool, cols: bool) -> torch.Tensor:
    if cols:
        x = gather_along(x, -1, grid.group("row"))
    if rows:  # row block k*q + i: the column (i) first, then the depth (k)
        x = gather_along(x, 0, grid.group("col"))
        x = gather_along(x, 0, grid.group("dep"))
    return x


class _SplitRowsCols(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, grid: Grid2p5D, rows: bool, cols: bool) -> torch.Tensor:
        ctx.args = (grid, rows, cols)
        return _split(x, grid, rows, cols)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _gather(grad.contiguous(), *ctx.args), None, None, None


class _GatherRowsCols(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, grid: Grid2p5D, rows: bool, cols: bool) -> torch.Tensor:
        ctx.args = (grid, rows, cols)
        return _gather(x, *ctx.args)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _split(grad, *ctx.args), None, None, None


def split_rows_cols(x: torch.Tensor, grid: Grid2p5D, rows: bool, cols: bool) -> torch.Tensor:
    """This rank's rows (block ``k*q + i`` of ``d*q`` along dim 0) and/or columns (block ``j``).

    Differentiable: the backward gathers the gradient of the whole tensor on every rank.

    Raises:
        ValueError: A split dim is not divisible by its number of blocks.
    """
    if grid.dims.tp == 1 or not (rows or cols):
        return x
    if not x.requires_grad:
        return _split(x, grid, rows, cols)
    return _SplitRowsCols.apply(x, grid, rows, cols)


def gather_rows_cols(x: torch.Tensor, grid: Grid2p5D, rows: bool, cols: bool) -> torch.Tensor:
    """The whole tensor from every rank's rows and/or columns (inverse of ``split_rows_cols``).

    Differentiable: the backward keeps this rank's block of the gradient.
    """
    if grid.dims.tp == 1 or not (rows or cols):
        return x
    return _GatherRowsCols.apply(x, grid, rows, cols)
