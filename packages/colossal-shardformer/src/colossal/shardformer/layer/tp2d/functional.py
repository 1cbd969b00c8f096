"""Functional ops of 2D tensor parallelism, built on :mod:`._primitives`.

Activations between 2D layers are split into q x q blocks (:mod:`._grid`): rank ``(i, j)``
holds rows block ``i`` (dim 0, the batch) and columns block ``j`` (the last dim). Layers that
read data (the embeddings, the patch embedding) take the *whole* batch, the same on every
rank, and keep their rows.

Parameters split ``q*q`` ways (biases, norms, the embeddings' columns) are stored as block
``i`` of block ``j`` and gathered over the column when used (:func:`~._primitives.gather_params`,
ColossalAI's ``all_gather_tensor_2d``), so every parameter takes ``1/q^2`` of the memory.

:func:`split_input_2d` / :func:`gather_output_2d` turn a whole activation into this rank's
block and back; :func:`split_batch_2d` / :func:`gather_batch_2d` do the same for rows only
(ids, labels, a classifier's replicated logits).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812 - the usual alias

from colossal.core import ParallelDims
from colossal.shardformer.layer.tp2d._grid import Grid2D
from colossal.shardformer.layer.tp2d._primitives import (
    Linear2DFn,
    Normalize2DFn,
    VocabClassifier2DFn,
    VocabEmbedding2DFn,
    gather_blocks,
    gather_params,
    reduce_forward,
    reduce_grad,
    split_blocks,
)

__all__ = [
    "classifier_2d",
    "embedding_2d",
    "gather_batch_2d",
    "gather_output_2d",
    "layer_norm_2d",
    "linear_2d",
    "patch_embedding_2d",
    "split_batch_2d",
    "split_input_2d",
    "vocab_parallel_classifier_2d",
    "vocab_parallel_embedding_2d",
]


def split_input_2d(x: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    """This rank's block of a whole activation ``(batch, ..., hidden)``.

    Rows block ``i`` of dim 0 and columns block ``j`` of the last dim: the seed page's
    ``chunk(x, q, 0)[col rank]`` then ``chunk(., q, -1)[row rank]``. Differentiable: the
    gradient of ``x`` is gathered whole on every rank.

    Raises:
        ValueError: The batch or the width is not divisible by ``q``.
    """
    return split_blocks(x, Grid2D(dims), rows=True, cols=True)


def gather_output_2d(y: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    """The whole activation from every rank's block (inverse of :func:`split_input_2d`)."""
    return gather_blocks(y, Grid2D(dims), rows=True, cols=True)


def split_batch_2d(x: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    """This rank's rows (block ``i`` of dim 0) of a whole batch; other dims kept whole."""
    return split_blocks(x, Grid2D(dims), rows=True, cols=False)


def gather_batch_2d(y: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    """The whole batch from every rank's rows (e.g. :class:`~.linear.Classifier2D` logits)."""
    return gather_blocks(y, Grid2D(dims), rows=True, cols=False)


def _add_bias(y: torch.Tensor, bias: torch.Tensor | None, grid: Grid2D) -> torch.Tensor:
    """``y + bias``, the bias stored as ``q*q`` pieces and gathered over the column."""
    if bias is None:
        return y
    return y + gather_params([bias], [0], grid)[0]


def linear_2d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, grid: Grid2D
) -> torch.Tensor:
    """``x @ weight.T + bias`` by SUMMA.

    Args:
        x: ``X_ij``, ``(n/q, ..., in/q)``.
        weight: ``(out/q, in/q)``: rows block ``j``, columns block ``i`` of the whole
            ``(out, in)`` weight.
        bias: ``(out/q^2,)``: piece ``i`` of block ``j`` of the whole bias, or None.
        grid: The 2D grid.

    Returns:
        ``Y_ij``, ``(n/q, ..., out/q)``.
    """
    return _add_bias(Linear2DFn.apply(x, weight, grid), bias, grid)


def vocab_parallel_classifier_2d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, grid: Grid2D
) -> torch.Tensor:
    """Logits of this rank's classes: ``x @ weight.T + bias`` with the weight in place.

    Args:
        x: ``X_ij``, ``(n/q, ..., in/q)``.
        weight: ``(C/q, in/q)``: rows block ``i``, columns block ``j`` of the whole
            ``(C, in)`` weight (a vocabulary-parallel embedding's layout).
        bias: ``(C/q^2,)``: piece ``i`` of block ``j`` of the whole bias, or None.
        grid: The 2D grid.

    Returns:
        ``(n/q, ..., C/q)``: rows block ``i``, classes block ``j``.
    """
    return _add_bias(VocabClassifier2DFn.apply(x, weight, grid), bias, grid)


def classifier_2d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, grid: Grid2D
) -> torch.Tensor:
    """Logits of every class for this rank's rows, the same on every rank of the row.

    Args:
        x: ``X_ij``, ``(n/q, ..., in/q)``.
        weight: ``(C, in/q^2)``: piece ``i`` of columns block ``j`` of the whole ``(C, in)``
            weight (an :class:`~.embedding.Embedding2D`'s layout), gathered over the column.
        bias: ``(C,)``, held whole by every rank (its gradient summed over the column).
        grid: The 2D grid.

    Returns:
        ``(n/q, ..., C)``: rows block ``i``, every class.
    """
    held = gather_params([weight], [1], grid)[0]
    y = reduce_forward(torch.matmul(x, held.t()), grid.row_group)
    if bias is None:
        return y
    return y + reduce_grad(bias, grid.col_group)


def layer_norm_2d(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    width: int,
    eps: float,
    grid: Grid2D,
) -> torch.Tensor:
    """Layer normalization over a hidden dim split along the row.

    Args:
        x: ``(n/q, ..., width/q)``.
        weight: ``(width/q^2,)``, piece ``i`` of block ``j``, or None.
        bias: Like ``weight``, or None.
        width: The whole normalized width.
        eps: Added to the variance.
        grid: The 2D grid.
    """
    z = Normalize2DFn.apply(x, width, eps, grid.row_group)
    affine = [t for t in (weight, bias) if t is not None]
    if not affine:
        return z
    held = gather_params(affine, [0] * len(affine), grid)
    if weight is not None:
        z = z * held[0]
    return z + held[-1] if bias is not None else z


def embedding_2d(
    ids: torch.Tensor, weight: torch.Tensor, grid: Grid2D, padding_idx: int | None = None
) -> torch.Tensor:
    """Lookup of this rank's rows in a ``(V, D/q^2)`` weight gathered over the column.

    Args:
        ids: The whole batch of ids ``(n, ...)``.
        weight: Piece ``i`` of columns block ``j`` of the whole ``(V, D)`` embedding.
        grid: The 2D grid.
        padding_idx: An id whose row gets no gradient.

    Returns:
        ``(n/q, ..., D/q)``: rows block ``i``, columns block ``j``.
    """
    rows = split_blocks(ids, grid, rows=True, cols=False)
    held = gather_params([weight], [1], grid)[0]
    return F.embedding(rows, held, padding_idx)


def vocab_parallel_embedding_2d(
    ids: torch.Tensor, weight: torch.Tensor, grid: Grid2D, padding_idx: int | None = None
) -> torch.Tensor:
    """Lookup in a ``(V/q, D/q)`` weight: vocabulary block ``i``, columns block ``j``.

    Args:
        ids: The whole batch of ids ``(n, ...)`` (``n`` divisible by ``q``).
        weight: This rank's block of the whole ``(V, D)`` embedding.
        grid: The 2D grid.
        padding_idx: An id whose row gets no gradient.

    Returns:
        ``(n/q, ..., D/q)``: rows block ``i``, columns block ``j``.
    """
    if ids.shape[0] % grid.q:
        raise ValueError(
            f"vocab_parallel_embedding_2d: batch {ids.shape[0]} is not divisible by "
            f"q={grid.q}; pad the batch to a multiple of {grid.q}"
        )
    return VocabEmbedding2DFn.apply(ids, weight, grid, padding_idx)


def patch_embedding_2d(
    images: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cls_token: torch.Tensor,
    pos_embed: torch.Tensor,
    grid: Grid2D,
    patch_size: tuple[int, int],
    flatten: bool = True,
) -> torch.Tensor:
    """ViT patch embedding of this rank's images: patchify, class token, position embedding.

    Every parameter holds piece ``i`` of block ``j`` of the embedding dim; one all-gather
    over the column gives block ``j`` of all four (one reduce-scatter of their gradients).

    Args:
        images: The whole batch ``(n, channels, height, width)``.
        weight: ``(D/q^2, channels, p, p)``, the convolution's kernel.
        bias: ``(D/q^2,)`` or None.
        cls_token: ``(1, 1, D/q^2)``.
        pos_embed: ``(1, patches + 1, D/q^2)``.
        grid: The 2D grid.
        patch_size: The convolution's kernel and stride.
        flatten: Return ``(n/q, patches + 1, D/q)`` tokens; False: the convolution's map
            ``(n/q, D/q, h, w)`` without class token and position embedding.
    """
    rows = split_blocks(images, grid, rows=True, cols=False)
    params = [t for t in (weight, bias, cls_token, pos_embed) if t is not None]
    dims = [0] + [0] * (bias is not None) + [2, 2]
    held = gather_params(params, dims, grid)
    kernel, cls, pos = held[0], held[-2], held[-1]
    y = F.conv2d(rows, kernel, held[1] if bias is not None else None, stride=patch_size)
    if not flatten:
        return y
    y = y.flatten(2).transpose(1, 2)
    y = torch.cat([cls.expand(y.shape[0], -1, -1), y], dim=1)
    return y + pos
