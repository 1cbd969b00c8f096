"""Functional ops of 2.5D tensor parallelism, built on :mod:`._primitives`.

Activations between 2.5D layers are split as on the seed page (:mod:`._grid`): rank
``(k, i, j)`` holds rows block ``k*q + i`` of ``d*q`` (dim 0, the batch) and columns block
``j`` of ``q`` (the last dim). Layers that read data (the embeddings, the patch embedding)
take the *whole* batch, the same on every rank, and keep their rows.

Weights of the products are split q x q and replicated over the depth; the small parameters
(biases, norms' affine, the replicated embeddings and heads) hold block ``j`` of their
feature dim and are replicated over the depth and the column: their gradients are summed
over those ``d*q`` ranks in one all-reduce per layer (:func:`replicated_2p5d`).

:func:`split_input_2p5d` / :func:`gather_output_2p5d` turn a whole activation into this
rank's block and back; :func:`split_batch_2p5d` / :func:`gather_batch_2p5d` do the same for
rows only (ids, labels, a classifier's logits).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F  # noqa: N812 - the usual alias
from torch.distributed import ProcessGroup

from colossal.core import ParallelDims
from colossal.shardformer.layer.tp2p5d._grid import Grid2p5D
from colossal.shardformer.layer.tp2p5d._primitives import (
    Classifier2p5DFn,
    Linear2p5DFn,
    Normalize2p5DFn,
    VocabEmbedding2p5DFn,
    gather_rows_cols,
    reduce_forward,
    reduce_grad,
    split_rows_cols,
)

__all__ = [
    "classifier_2p5d",
    "embedding_2p5d",
    "gather_batch_2p5d",
    "gather_output_2p5d",
    "layer_norm_2p5d",
    "linear_2p5d",
    "patch_embedding_2p5d",
    "replicated_2p5d",
    "split_batch_2p5d",
    "split_input_2p5d",
    "vocab_parallel_classifier_2p5d",
    "vocab_parallel_embedding_2p5d",
]


def split_input_2p5d(x: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    """This rank's block of a whole activation ``(batch, ..., hidden)``.

    Rows block ``k*q + i`` of ``d*q`` along dim 0 and columns block ``j`` of ``q`` along the
    last dim: the seed page's ``chunk(x, d, 0)[dep]``, ``chunk(., q, 0)[col]``,
    ``chunk(., q, -1)[row]``. Differentiable: the gradient of ``x`` is gathered whole.

    Raises:
        ValueError: The batch is not divisible by ``d*q`` or the width by ``q``.
    """
    return split_rows_cols(x, Grid2p5D(dims), rows=True, cols=True)


def gather_output_2p5d(y: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    """The whole activation from every rank's block (inverse of :func:`split_input_2p5d`)."""
    return gather_rows_cols(y, Grid2p5D(dims), rows=True, cols=True)


def split_batch_2p5d(x: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    """This rank's rows of a whole batch (token ids, images, labels); columns kept whole."""
    return split_rows_cols(x, Grid2p5D(dims), rows=True, cols=False)


def gather_batch_2p5d(y: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    """The whole batch from every rank's rows (e.g. :class:`~.linear.Classifier2p5D` logits)."""
    return gather_rows_cols(y, Grid2p5D(dims), rows=True, cols=False)


def replicated_2p5d(tensors: Sequence[torch.Tensor], group: ProcessGroup) -> list[torch.Tensor]:
    """``tensors`` (copies held by every rank of ``group``) with their gradients summed.

    Each rank uses its copy on its own rows, so the whole gradient is the sum over
    ``group``: one all-reduce in the backward for all of ``tensors`` together.
    """
    if len(tensors) == 1:
        return [reduce_grad(tensors[0], group)]
    flat = reduce_grad(torch.cat([t.reshape(-1) for t in tensors]), group)
    return [
        piece.view_as(t)
        for piece, t in zip(flat.split([t.numel() for t in tensors]), tensors, strict=True)
    ]


def _add_bias(y: torch.Tensor, bias: torch.Tensor | None, grid: Grid2p5D) -> torch.Tensor:
    if bias is None:
        return y
    return y + replicated_2p5d([bias], grid.group("dep", "col"))[0].to(y.dtype)


def linear_2p5d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, grid: Grid2p5D
) -> torch.Tensor:
    """``x @ weight.T + bias`` of the Tesseract algorithm; the output in the input's layout.

    Args:
        x: ``(n, ..., in/q)``, block ``(k*q + i, j)`` of the whole activation.
        weight: ``(out/q, in/q)``: rows block ``j``, columns block ``i`` of the whole
            ``(out, in)`` weight, replicated over the depth.
        bias: ``(out/q,)``: block ``j`` of the whole bias, replicated over the depth and the
            column (its gradient is all-reduced over them), or None.
        grid: The 2.5D grid.
    """
    return _add_bias(Linear2p5DFn.apply(x, weight, grid), bias, grid)


def vocab_parallel_classifier_2p5d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, grid: Grid2p5D
) -> torch.Tensor:
    """Logits of this rank's classes: ``x @ weight.T + bias`` with classes split ``q`` ways.

    Args:
        x: ``(n, ..., in/q)``, block ``(k*q + i, j)``.
        weight: ``(C/q, in/q)``: classes block ``i``, columns block ``j`` (the layout of a
            :class:`~.embedding.VocabParallelEmbedding2p5D`'s weight).
        bias: ``(C/q,)`` block ``j``, replicated over the depth and the column, or None.
        grid: The 2.5D grid.

    Returns:
        ``(n, ..., C/q)``: this rank's rows and classes block ``j``.
    """
    return _add_bias(Classifier2p5DFn.apply(x, weight, grid), bias, grid)


def layer_norm_2p5d(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    width: int,
    eps: float,
    grid: Grid2p5D,
) -> torch.Tensor:
    """Layer normalization over a hidden dim split along the row group.

    Args:
        x: ``(n, ..., width/q)``, block ``(k*q + i, j)``.
        weight: ``(width/q,)`` block ``j``, replicated over the depth and column, or None.
        bias: Like ``weight``, or None.
        width: The whole normalized width.
        eps: Added to the variance.
        grid: The 2.5D grid.
    """
    z = Normalize2p5DFn.apply(x, width, eps, grid.group("row"))
    affine = [t for t in (weight, bias) if t is not None]
    if not affine:
        return z
    held = replicated_2p5d(affine, grid.group("dep", "col"))
    if weight is not None:
        z = z * held[0]
    return z + held[-1] if bias is not None else z


def embedding_2p5d(
    ids: torch.Tensor, weight: torch.Tensor, grid: Grid2p5D, padding_idx: int | None = None
) -> torch.Tensor:
    """Lookup in a ``(V, D/q)`` weight (columns block ``j``, replicated over depth and column).

    Args:
        ids: The whole batch of ids ``(batch, ...)`` (this rank keeps its rows).
        weight: This rank's columns of the whole ``(V, D)`` embedding.
        grid: The 2.5D grid.
        padding_idx: An id whose row gets no gradient.

    Returns:
        ``(batch/(d q), ..., D/q)``, block ``(k*q + i, j)``.
    """
    rows = split_rows_cols(ids, grid, rows=True, cols=False)
    held = replicated_2p5d([weight], grid.group("dep", "col"))[0]
    return F.embedding(rows, held, padding_idx)


def vocab_parallel_embedding_2p5d(
    ids: torch.Tensor, weight: torch.Tensor, grid: Grid2p5D, padding_idx: int | None = None
) -> torch.Tensor:
    """Lookup in a ``(V/q, D/q)`` weight: vocabulary block ``i``, columns block ``j``.

    Args:
        ids: The whole batch of ids ``(batch, ...)``.
        weight: This rank's part of the whole ``(V, D)`` embedding.
        grid: The 2.5D grid.
        padding_idx: An id whose row gets no gradient.

    Returns:
        ``(batch/(d q), ..., D/q)``, block ``(k*q + i, j)``.

    Raises:
        ValueError: The batch is not divisible by ``d*q``.
    """
    if ids.shape[0] % grid.row_blocks:
        raise ValueError(
            f"vocab_parallel_embedding_2p5d: batch {ids.shape[0]} is not divisible by "
            f"d*q={grid.row_blocks}; pad the batch to a multiple of {grid.row_blocks}"
        )
    per = ids.shape[0] // grid.depth  # the rows of this rank's layer k
    rows = ids.narrow(0, grid.k * per, per)
    return VocabEmbedding2p5DFn.apply(rows, weight, grid, padding_idx)


def classifier_2p5d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, grid: Grid2p5D
) -> torch.Tensor:
    """Logits of all classes: ``x @ weight.T`` summed over the row group, plus ``bias``.

    Args:
        x: ``(n, ..., in/q)``, block ``(k*q + i, j)``.
        weight: ``(C, in/q)``: columns block ``j``, replicated over depth and column.
        bias: ``(C,)`` replicated everywhere, or None.
        grid: The 2.5D grid.

    Returns:
        ``(n, ..., C)``: this rank's rows, the same on every rank of the row group.
    """
    held = replicated_2p5d([t for t in (weight, bias) if t is not None], grid.group("dep", "col"))
    y = reduce_forward(torch.matmul(x, held[0].t()), grid.group("row"))
    return y + held[1].to(y.dtype) if bias is not None else y


def patch_embedding_2p5d(
    images: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cls_token: torch.Tensor,
    pos_embed: torch.Tensor,
    grid: Grid2p5D,
    patch_size: tuple[int, int],
    flatten: bool = True,
) -> torch.Tensor:
    """ViT patch embedding: patchify convolution, class token, position embedding.

    Every parameter holds block ``j`` of the embedding dim and is replicated over the depth
    and the column (one all-reduce of all their gradients in the backward).

    Args:
        images: The whole batch ``(batch, channels, height, width)``.
        weight: ``(D/q, channels, p, p)``, the convolution's kernel.
        bias: ``(D/q,)`` or None.
        cls_token: ``(1, 1, D/q)``.
        pos_embed: ``(1, patches + 1, D/q)``.
        grid: The 2.5D grid.
        patch_size: The convolution's kernel and stride.
        flatten: Return ``(n, patches + 1, D/q)``; False: the convolution's output
            ``(n, D/q, h, w)`` without class token and position embedding.
    """
    rows = split_rows_cols(images, grid, rows=True, cols=False)
    params = [t for t in (weight, bias, cls_token, pos_embed) if t is not None]
    held = replicated_2p5d(params, grid.group("dep", "col"))
    weight, cls_token, pos_embed = held[0], held[-2], held[-1]
    y = F.conv2d(rows, weight, held[1] if bias is not None else None, stride=patch_size)
    if not flatten:
        return y
    y = y.flatten(2).transpose(1, 2)
    y = torch.cat([cls_token.expand(y.shape[0], -1, -1), y], dim=1)
    return y + pos_embed
