"""Differentiable communication primitives of 3D tensor parallelism.

Every collective goes through :mod:`colossal.core.comm`, so
:class:`~colossal.core.CommTracker` counts it. With ``n`` the local rows, ``q`` the cube's side
and ``I``, ``W``, ``O`` the groups along the layer's input, weight and output axes:

=========================  ==================================  ===============================
primitive                  forward                             backward
=========================  ==================================  ===============================
``Linear3DFn``             all-gather x (I), weight (W);       all-gather dy (O);
                           matmul; reduce-scatter y (O)        reduce-scatter dx (I), dw (W)
``VocabEmbedding3DFn``     all-gather weight (W); lookup of    all-gather dy (I);
                           this vocab block; reduce-scatter    reduce-scatter dw (W)
                           (I)
``Normalize3DFn``          all-reduce row sums, then squared   one all-reduce of two row sums
                           deviations (O)                      (O)
``reduce_grad``            identity                            all-reduce of the gradient
``reduce_forward``         all-reduce                          identity
``split_rows_cols`` /      keep / gather this rank's rows and  the other one
``gather_rows_cols``       columns
``batch_mean``             all-reduce of (sum, count)          gradient / count
=========================  ==================================  ===============================

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
from colossal.shardformer.layer.tp3d._cube import Cube3D

__all__ = [
    "Linear3DFn",
    "Normalize3DFn",
    "VocabEmbedding3DFn",
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
    # (size, ..., n, ...) -> (..., size, n, ...) -> (..., size * n, ...)
    shape = (*x.shape[:dim], size * x.shape[dim], *x.shape[dim + 1 :])
    return buf.reshape(shape) if dim == 0 else buf.movedim(0, dim).reshape(shape)


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
            f"3D tensor parallel: dim {dim} of a tensor of shape {tuple(x.shape)} is not "
            f"divisible by the group size {size}; pad it to a multiple of {size}"
        )
    split = x.reshape(*x.shape[:dim], size, n // size, *x.shape[dim + 1 :])
    chunks = split.movedim(dim, 0).contiguous()
    out = x.new_empty(chunks.shape[1:])
    reduce_scatter(out, chunks, group=group)
    return out


def _block(x: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
    """Block ``index`` of ``parts`` equal blocks of ``x`` along ``dim``."""
    n = x.shape[dim]
    if n % parts:
        raise ValueError(
            f"3D tensor parallel: dim {dim % x.dim()} of a tensor of shape {tuple(x.shape)} "
            f"is not divisible by {parts}; pad it to a multiple of {parts}"
        )
    step = n // parts
    return x.narrow(dim, index * step, step)


# ---- the linear layer's algorithm ----------------------------------------------------------


class Linear3DFn(torch.autograd.Function):
    """``y = x @ w.T`` of the 3D algorithm (weight in torch's ``(out, in)`` layout).

    ``x``: ``(n, ..., in/q)`` in the cube's orientation; ``weight``: ``(out/q^2, in/q)``, rows
    block ``input * q + weight`` and columns block ``output`` of the whole weight. Returns
    ``(n, ..., out/q)`` laid out in the flipped orientation.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, cube: Cube3D) -> torch.Tensor:
        x_full = gather_along(x, 0, cube.group("input"))
        w_full = gather_along(weight, 0, cube.group("weight"))
        y_full = torch.matmul(x_full, w_full.t())
        ctx.cube = cube
        ctx.save_for_backward(x_full, w_full)
        return reduce_scatter_along(y_full, 0, cube.group("output"))

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_full, w_full = ctx.saved_tensors
        cube: Cube3D = ctx.cube
        dy_full = gather_along(dy.contiguous(), 0, cube.group("output"))
        # Under autocast the forward multiplied in a lower precision: so does the backward
        # (autograd casts each returned gradient to its input's dtype).
        x_full, w_full = x_full.to(dy_full.dtype), w_full.to(dy_full.dtype)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = reduce_scatter_along(torch.matmul(dy_full, w_full), 0, cube.group("input"))
        if ctx.needs_input_grad[1]:
            dw_full = torch.matmul(
                dy_full.reshape(-1, dy_full.shape[-1]).t(), x_full.reshape(-1, x_full.shape[-1])
            )
            dw = reduce_scatter_along(dw_full, 0, cube.group("weight"))
        return dx, dw, None


class VocabEmbedding3DFn(torch.autograd.Function):
    """Lookup of a vocabulary-parallel embedding.

    ``ids``: ``(n*q, ...)``, the rows of this rank's weight-axis block; ``weight``:
    ``(V/q^2, D/q)``, vocabulary block ``input * q + weight`` and columns block ``output``.
    Each rank of the input group looks up its ``V/q`` vocabulary block, and the
    reduce-scatter over it sums the blocks and keeps this rank's rows: ``(n, ..., D/q)``.
    """

    @staticmethod
    def forward(
        ctx: Any,
        ids: torch.Tensor,
        weight: torch.Tensor,
        cube: Cube3D,
        padding_idx: int | None,
    ) -> torch.Tensor:
        w_full = gather_along(weight, 0, cube.group("weight"))
        per = w_full.shape[0]
        local = ids - cube.coordinate("input") * per
        outside = (local < 0) | (local >= per)
        local = local.masked_fill(outside, 0)
        out = F.embedding(local, w_full)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        keep = ~outside if padding_idx is None else ~outside & (ids != padding_idx)
        ctx.cube, ctx.rows = cube, per
        ctx.save_for_backward(local, keep)
        return reduce_scatter_along(out, 0, cube.group("input"))

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        local, keep = ctx.saved_tensors
        cube: Cube3D = ctx.cube
        dy_full = gather_along(dy.contiguous(), 0, cube.group("input"))
        dw_full = dy_full.new_zeros((ctx.rows, dy_full.shape[-1]))
        dw_full.index_add_(0, local[keep], dy_full[keep])
        return None, reduce_scatter_along(dw_full, 0, cube.group("weight")), None, None


class Normalize3DFn(torch.autograd.Function):
    """``(x - mean) / sqrt(var + eps)`` over a feature dim split along ``group``.

    ``x``: ``(..., h/q)``; the mean and the (biased) variance of the whole ``h`` come from
    two all-reduces of row sums (two passes: no cancellation for large means).
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


# ---- replicated tensors --------------------------------------------------------------------


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


class _ReduceForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        out = x.contiguous().clone()
        all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def reduce_grad(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Identity forward; the gradient all-reduced over ``group`` backward.

    For a tensor replicated over ``group`` (a parameter every rank of it holds) used by each
    rank on different rows: the sum gives every copy the whole gradient.
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
        both = torch.stack([total.detach().float(), count.float()])
        if group_size(group) > 1:
            all_reduce(both, group=group)
        ctx.count = both[1]
        return (both[0] / both[1]).to(total.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return (grad / ctx.count).to(grad.dtype), None, None


def batch_mean(total: torch.Tensor, count: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """The mean over ``group``'s rows: ``sum(total) / sum(count)`` (one all-reduce).

    ``total`` is this rank's scalar sum of per-row values, ``count`` its number of rows; the
    result is the same on every rank, and its gradient reaches ``total`` as ``1 / count``
    (each rank back-propagates the same replicated mean).
    """
    return _BatchMean.apply(total, count, group)


# ---- activations: this rank's rows and columns ---------------------------------------------


def _split(x: torch.Tensor, cube: Cube3D, rows: bool, cols: bool) -> torch.Tensor:
    q = cube.depth
    if rows:
        x = _block(x, 0, q * q, cube.row_block)
    if cols:
        x = _block(x, -1, q, cube.coordinate("output"))
    return x.contiguous()


def _gather(x: torch.Tensor, cube: Cube3D, rows: bool, cols: bool) -> torch.Tensor:
    if cols:
        x = gather_along(x, -1, cube.group("output"))
    if rows:  # row block weight * q + input: the input axis first, then the weight axis
        x = gather_along(x, 0, cube.group("input"))
        x = gather_along(x, 0, cube.group("weight"))
    return x


class _SplitRowsCols(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cube: Cube3D, rows: bool, cols: bool) -> torch.Tensor:
        ctx.args = (cube, rows, cols)
        return _split(x, cube, rows, cols)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _gather(grad.contiguous(), *ctx.args), None, None, None


class _GatherRowsCols(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cube: Cube3D, rows: bool, cols: bool) -> torch.Tensor:
        ctx.args = (cube, rows, cols)
        return _gather(x, *ctx.args)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _split(grad, *ctx.args), None, None, None


def split_rows_cols(x: torch.Tensor, cube: Cube3D, rows: bool, cols: bool) -> torch.Tensor:
    """This rank's rows (block ``weight * q + input`` of dim 0) and/or columns (last dim).

    Differentiable: the backward gathers the gradient of the whole tensor on every rank.
    """
    if cube.depth == 1 or not (rows or cols):
        return x
    if not x.requires_grad:
        return _split(x, cube, rows, cols)
    return _SplitRowsCols.apply(x, cube, rows, cols)


def gather_rows_cols(x: torch.Tensor, cube: Cube3D, rows: bool, cols: bool) -> torch.Tensor:
    """The whole tensor of this rank's rows and/or columns (inverse of :func:`split_rows_cols`).

    Differentiable: the backward keeps this rank's block of the gradient.
    """
    if cube.depth == 1 or not (rows or cols):
        return x
    return _GatherRowsCols.apply(x, cube, rows, cols)
