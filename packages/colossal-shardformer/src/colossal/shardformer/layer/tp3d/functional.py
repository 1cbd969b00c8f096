"""Functional ops of 3D tensor parallelism, built on :mod:`._primitives`.

Activations between 3D layers are laid out in a :class:`~._cube.Cube3D` orientation: rows
(dim 0, the batch) in ``q*q`` blocks indexed ``weight * q + input``, the last dim in ``q``
blocks indexed by the output-axis coordinate. Layers that read data (embeddings, the patch
embedding) take the *whole* batch, the same on every rank, and keep their rows.

:func:`split_input_3d` / :func:`gather_output_3d` turn a whole activation into this rank's
part and back (the tests and model integrations use them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F  # noqa: N812 - the usual alias

from colossal.core import ParallelDims
from colossal.shardformer.layer.tp3d._cube import Cube3D
from colossal.shardformer.layer.tp3d._primitives import (
    Linear3DFn,
    Normalize3DFn,
    VocabEmbedding3DFn,
    gather_rows_cols,
    reduce_forward,
    reduce_grad,
    split_rows_cols,
)

__all__ = [
    "classifier_3d",
    "embedding_3d",
    "gather_batch_3d",
    "gather_output_3d",
    "layer_norm_3d",
    "linear_3d",
    "patch_embedding_3d",
    "replicated_3d",
    "split_batch_3d",
    "split_input_3d",
    "vocab_parallel_embedding_3d",
]


def split_input_3d(x: torch.Tensor, dims: ParallelDims, swapped: bool = False) -> torch.Tensor:
    """This rank's part of a whole activation ``(batch, ..., hidden)``.

    Rows block ``weight * q + input`` of ``q*q`` along dim 0 and columns block ``output`` of
    ``q`` along the last dim, in the orientation ``swapped`` (the seed page's
    ``chunk(x, q, 0)[weight]``, ``chunk(., q, 0)[input]``, ``chunk(., q, -1)[output]``).
    Differentiable: the gradient of ``x`` is gathered whole on every rank.

    Raises:
        ValueError: The batch is not divisible by ``q*q`` or the width by ``q``.
    """
    return split_rows_cols(x, Cube3D(dims, swapped), rows=True, cols=True)


def gather_output_3d(y: torch.Tensor, dims: ParallelDims, swapped: bool = False) -> torch.Tensor:
    """The whole activation from every rank's part (inverse of :func:`split_input_3d`).

    Pass the orientation the part is laid out in: a :class:`~.linear.Linear3D` built with
    ``swapped=s`` returns parts laid out with ``swapped=not s`` (its ``output_swapped``).
    """
    return gather_rows_cols(y, Cube3D(dims, swapped), rows=True, cols=True)


def split_batch_3d(x: torch.Tensor, dims: ParallelDims, swapped: bool = False) -> torch.Tensor:
    """This rank's rows of a whole batch (token ids, images, labels); columns kept whole."""
    return split_rows_cols(x, Cube3D(dims, swapped), rows=True, cols=False)


def gather_batch_3d(y: torch.Tensor, dims: ParallelDims, swapped: bool = False) -> torch.Tensor:
    """The whole batch from every rank's rows (e.g. :class:`~.linear.Classifier3D` logits)."""
    return gather_rows_cols(y, Cube3D(dims, swapped), rows=True, cols=False)


def replicated_3d(
    tensors: Sequence[torch.Tensor], group: torch.distributed.ProcessGroup
) -> list[torch.Tensor]:
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


def linear_3d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cube: Cube3D
) -> torch.Tensor:
    """``x @ weight.T + bias`` of the 3D algorithm; the output in ``cube.flipped()``.

    Args:
        x: ``(n, ..., in/q)`` in ``cube``'s orientation.
        weight: ``(out/q^2, in/q)``: rows block ``input * q + weight``, columns block
            ``output`` of the whole ``(out, in)`` weight.
        bias: ``(out/q,)``: block ``input`` of the whole bias, replicated along the weight and
            output axes (its gradient is all-reduced over them), or None.
        cube: The cube in this layer's orientation.
    """
    y = Linear3DFn.apply(x, weight, cube)
    if bias is not None:
        y = y + replicated_3d([bias], cube.group("weight", "output"))[0].to(y.dtype)
    return y


def layer_norm_3d(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    width: int,
    eps: float,
    cube: Cube3D,
) -> torch.Tensor:
    """Layer normalization over a hidden dim split along the output axis.

    Args:
        x: ``(n, ..., width/q)`` in ``cube``'s orientation.
        weight: ``(width/q,)`` block ``output``, replicated along input and weight, or None.
        bias: Like ``weight``, or None.
        width: The whole normalized width.
        eps: Added to the variance.
        cube: The cube in this layer's orientation.
    """
    z = Normalize3DFn.apply(x, width, eps, cube.group("output"))
    affine = [t for t in (weight, bias) if t is not None]
    if not affine:
        return z
    held = replicated_3d(affine, cube.group("input", "weight"))
    if weight is not None:
        z = z * held[0]
    return z + held[-1] if bias is not None else z


def embedding_3d(
    ids: torch.Tensor, weight: torch.Tensor, cube: Cube3D, padding_idx: int | None = None
) -> torch.Tensor:
    """Lookup in a ``(V, D/q)`` weight (columns block ``output``, replicated elsewhere).

    Args:
        ids: The whole batch of ids ``(batch, ...)`` (this rank keeps its rows).
        weight: This rank's columns of the whole ``(V, D)`` embedding.
        cube: The cube in this layer's orientation.
        padding_idx: An id whose row gets no gradient.

    Returns:
        ``(batch/q^2, ..., D/q)`` in ``cube``'s orientation.
    """
    rows = split_rows_cols(ids, cube, rows=True, cols=False)
    held = replicated_3d([weight], cube.group("input", "weight"))[0]
    return F.embedding(rows, held, padding_idx)


def vocab_parallel_embedding_3d(
    ids: torch.Tensor, weight: torch.Tensor, cube: Cube3D, padding_idx: int | None = None
) -> torch.Tensor:
    """Lookup in a ``(V/q^2, D/q)`` weight: vocabulary block ``input * q + weight``.

    Args:
        ids: The whole batch of ids ``(batch, ...)``.
        weight: This rank's part of the whole ``(V, D)`` embedding.
        cube: The cube in this layer's orientation.
        padding_idx: An id whose row gets no gradient.

    Returns:
        ``(batch/q^2, ..., D/q)`` in ``cube``'s orientation.
    """
    q = cube.depth
    if ids.shape[0] % (q * q):
        raise ValueError(
            f"vocab_parallel_embedding_3d: batch {ids.shape[0]} is not divisible by "
            f"q*q={q * q}; pad the batch to a multiple of {q * q}"
        )
    per = ids.shape[0] // q  # the rows of this rank's weight-axis block
    rows = ids.narrow(0, cube.coordinate("weight") * per, per)
    return VocabEmbedding3DFn.apply(rows, weight, cube, padding_idx)


def classifier_3d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cube: Cube3D
) -> torch.Tensor:
    """Logits of all classes: ``x @ weight.T`` summed over the output axis, plus ``bias``.

    Args:
        x: ``(n, ..., in/q)`` in ``cube``'s orientation.
        weight: ``(C, in/q)``: columns block ``output``, replicated along input and weight.
        bias: ``(C,)`` replicated everywhere, or None.
        cube: The cube in this layer's orientation.

    Returns:
        ``(n, ..., C)``: this rank's rows, the same on every rank of the output axis.
    """
    held = replicated_3d(
        [t for t in (weight, bias) if t is not None], cube.group("input", "weight")
    )
    y = reduce_forward(torch.matmul(x, held[0].t()), cube.group("output"))
    return y + held[1].to(y.dtype) if bias is not None else y


def patch_embedding_3d(
    images: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cls_token: torch.Tensor,
    pos_embed: torch.Tensor,
    cube: Cube3D,
    patch_size: tuple[int, int],
    flatten: bool = True,
) -> torch.Tensor:
    """ViT patch embedding: patchify convolution, class token, position embedding.

    Every parameter holds block ``output`` of the embedding dim and is replicated along the
    input and weight axes (one all-reduce of all their gradients in the backward).

    Args:
        images: The whole batch ``(batch, channels, height, width)``.
        weight: ``(D/q, channels, p, p)``, the convolution's kernel.
        bias: ``(D/q,)`` or None.
        cls_token: ``(1, 1, D/q)``.
        pos_embed: ``(1, patches + 1, D/q)``.
        cube: The cube in this layer's orientation.
        patch_size: The convolution's kernel and stride.
        flatten: Return ``(n, patches + 1, D/q)``; False: the convolution's output
            ``(n, D/q, h, w)`` without class token and position embedding.
    """
    rows = split_rows_cols(images, cube, rows=True, cols=False)
    params = [t for t in (weight, bias, cls_token, pos_embed) if t is not None]
    held = replicated_3d(params, cube.group("input", "weight"))
    weight, cls_token, pos_embed = held[0], held[-2], held[-1]
    y = F.conv2d(rows, weight, held[1] if bias is not None else None, stride=patch_size)
    if not flatten:
        return y
    y = y.flatten(2).transpose(1, 2)
    y = torch.cat([cls_token.expand(y.shape[0], -1, -1), y], dim=1)
    return y + pos_embed
