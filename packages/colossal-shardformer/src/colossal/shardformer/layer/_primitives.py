"""Differentiable communication primitives of the tensor-parallel region (Megatron's f and g).

Each is an autograd Function whose forward and backward communicate only through
:mod:`colossal.core.comm`, so :class:`~colossal.core.CommTracker` counts every byte:

============================  ==========================  ==============================
primitive                     forward                     backward
============================  ==========================  ==============================
``copy_to_tp_region``         identity                    all-reduce of the gradient
``reduce_from_tp_region``     all-reduce                  identity
``gather_from_tp_region``     all-gather along last dim   keep this rank's slice
``split_to_tp_region``        keep this rank's slice      all-gather along last dim
``gather_sequence_to_tp``     all-gather along sequence   reduce-scatter along sequence
``reduce_scatter_sequence``   reduce-scatter along seq.   all-gather along sequence
============================  ==========================  ==============================

The last two are Megatron sequence parallelism's replacements of ``f`` and ``g`` (the
``split_gather`` mode): activations outside the tensor-parallel region hold this rank's
contiguous slice of the sequence (dim 1 of a batch-first ``(batch, seq, ...)`` tensor; a
tensor flattened to ``(batch * seq, ...)`` needs ``batch_size``), so the region's entry
all-gathers the sequence and its exit reduce-scatters it.

With a group of one rank every primitive is the identity and communicates nothing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ProcessGroup

from colossal.core.comm import all_gather, all_reduce, reduce_scatter
from colossal.shardformer.layer._utils import group_rank, group_size

__all__ = [
    "copy_to_tp_region",
    "gather_from_tp_region",
    "gather_seq",
    "gather_sequence_to_tp",
    "is_in_tp_region",
    "mark_tp_region",
    "reduce_from_tp_region",
    "reduce_scatter_seq",
    "reduce_scatter_sequence",
    "scale_grad",
    "split_to_tp_region",
]

_REGION_ATTR = "_colossal_tp_region_group"
_WORLD = object()  # tag value standing for the default group


def _all_reduce(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    out = x.contiguous().clone()
    all_reduce(out, group=group)
    return out


def _gather_last(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    tp = group_size(group)
    x = x.contiguous()
    buf = x.new_empty((tp, *x.shape))
    all_gather(buf, x, group=group)
    # (tp, ..., n) -> (..., tp, n) -> (..., tp * n)
    return buf.movedim(0, -2).reshape(*x.shape[:-1], tp * x.shape[-1])


def _split_last(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    tp, rank = group_size(group), group_rank(group)
    n = x.shape[-1]
    if n % tp != 0:
        raise ValueError(
            f"split_to_tp_region: last dim {n} is not divisible by the tensor-parallel size "
            f"{tp}; pad the input or choose a TP size dividing it"
        )
    step = n // tp
    return x[..., rank * step : (rank + 1) * step].contiguous()


def _as_batch_seq(x: torch.Tensor, batch_size: int | None) -> torch.Tensor:
    """``x`` as ``(batch, seq, ...)``: a tensor flattened to ``(batch * seq, h)`` is unflattened."""
    if x.dim() >= 3:
        return x
    if x.dim() == 2 and batch_size is not None and x.shape[0] % batch_size == 0:
        return x.reshape(batch_size, x.shape[0] // batch_size, x.shape[1])
    raise ValueError(
        f"sequence parallelism: cannot find the sequence dim of a tensor of shape "
        f"{tuple(x.shape)} (batch size {batch_size}); layers inside the stack must see "
        "(batch, seq, hidden) or (batch * seq, hidden) activations"
    )


def _restore(y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Flatten ``y`` back to 2-D when the input ``like`` was flattened."""
    return y.reshape(-1, y.shape[-1]) if like.dim() == 2 else y


def gather_seq(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """All-gather ``(b, s/P, ...)`` shards (rank order) into ``(b, s, ...)``; not differentiable."""
    size = group_size(group)
    x = x.contiguous()
    buf = x.new_empty((size, *x.shape))
    all_gather(buf, x, group=group)
    # (P, b, s/P, ...) -> (b, P, s/P, ...) -> (b, s, ...)
    return buf.movedim(0, 1).reshape(x.shape[0], size * x.shape[1], *x.shape[2:])


def reduce_scatter_seq(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Sum ``(b, s, ...)`` over ``group``, keep this rank's ``(b, s/P, ...)``; not differentiable.

    Raises:
        ValueError: ``s`` is not divisible by the group size.
    """
    size = group_size(group)
    s = x.shape[1]
    if s % size != 0:
        raise ValueError(
            f"sequence parallelism: sequence length {s} is not divisible by the group size "
            f"{size}; pad the sequence to a multiple of {size}"
        )
    chunks = x.reshape(x.shape[0], size, s // size, *x.shape[2:]).movedim(1, 0).contiguous()
    out = x.new_empty(chunks.shape[1:])
    reduce_scatter(out, chunks, group=group)
    return out


class _GatherSequenceToTP(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: ProcessGroup | None, batch_size: int | None
    ) -> torch.Tensor:
        ctx.group, ctx.batch_size = group, batch_size
        return _restore(gather_seq(_as_batch_seq(x, batch_size), group), x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        out = reduce_scatter_seq(_as_batch_seq(grad, ctx.batch_size), ctx.group)
        return _restore(out, grad), None, None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: ProcessGroup | None, batch_size: int | None
    ) -> torch.Tensor:
        ctx.group, ctx.batch_size = group, batch_size
        return _restore(reduce_scatter_seq(_as_batch_seq(x, batch_size), group), x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        out = gather_seq(_as_batch_seq(grad, ctx.batch_size), ctx.group)
        return _restore(out, grad), None, None


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: ProcessGroup | None, inplace: bool
    ) -> torch.Tensor:
        if not inplace:
            return _all_reduce(x, group)
        ctx.mark_dirty(x)
        all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _split_last(grad, ctx.group), None


class _SplitToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_last(grad, ctx.group), None


def copy_to_tp_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient over ``group`` backward (Megatron's f)."""
    if group_size(group) == 1:
        return x
    return _CopyToRegion.apply(x, group)


def reduce_from_tp_region(
    x: torch.Tensor, group: ProcessGroup | None, inplace: bool = False
) -> torch.Tensor:
    """All-reduce over ``group`` forward; identity backward (Megatron's g).

    Args:
        x: This rank's partial sum.
        group: The tensor-parallel group (the whole job when None).
        inplace: Reduce into ``x`` itself (saves a copy; only for a fresh, contiguous tensor
            no other autograd node saved, such as a matmul's output).
    """
    if group_size(group) == 1:
        return x
    return _ReduceFromRegion.apply(x, group, inplace and x.is_contiguous())


def gather_from_tp_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dim (rank order); backward keeps the slice."""
    if group_size(group) == 1:
        return x
    return _GatherFromRegion.apply(x, group)


def split_to_tp_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Keep this rank's equal slice of the last dim; backward all-gathers the gradient.

    Raises:
        ValueError: The last dim is not divisible by the group size.
    """
    if group_size(group) == 1:
        return x
    return _SplitToRegion.apply(x, group)


def gather_sequence_to_tp(
    x: torch.Tensor, group: ProcessGroup | None, batch_size: int | None = None
) -> torch.Tensor:
    """All-gather the sequence shards of ``group`` (forward); reduce-scatter the gradient.

    The sequence-parallel entry of the tensor-parallel region (replaces
    :func:`copy_to_tp_region`): every rank's contiguous slice of dim 1, in rank order.

    Args:
        x: ``(batch, seq / P, ...)``, or ``(batch * seq / P, hidden)`` with ``batch_size``.
        group: The tensor-parallel group (the whole job when None).
        batch_size: The batch size of a flattened 2-D ``x``.
    """
    if group_size(group) == 1:
        return x
    return _GatherSequenceToTP.apply(x, group, batch_size)


def reduce_scatter_sequence(
    x: torch.Tensor, group: ProcessGroup | None, batch_size: int | None = None
) -> torch.Tensor:
    """Sum partial outputs over ``group`` keeping this rank's sequence slice; backward gathers.

    The sequence-parallel exit of the tensor-parallel region (replaces
    :func:`reduce_from_tp_region` in a row-parallel layer).

    Args:
        x: ``(batch, seq, ...)``, or ``(batch * seq, hidden)`` with ``batch_size``.
        group: The tensor-parallel group (the whole job when None).
        batch_size: The batch size of a flattened 2-D ``x``.

    Raises:
        ValueError: The sequence length is not divisible by the group size.
    """
    if group_size(group) == 1:
        return x
    return _ReduceScatterSequence.apply(x, group, batch_size)


def mark_tp_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Tag ``x`` as having entered the TP region of ``group`` (its gradient is all-reduced)."""
    setattr(x, _REGION_ATTR, _WORLD if group is None else group)
    return x


def is_in_tp_region(x: torch.Tensor, group: ProcessGroup | None) -> bool:
    """Whether ``x`` is the exact tensor :func:`mark_tp_region` tagged for ``group``."""
    tag = getattr(x, _REGION_ATTR, None)
    return tag is not None and tag is (_WORLD if group is None else group)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` unchanged; its gradient multiplied by ``scale`` (e.g. ``1 / tp`` before a sum)."""
    return _ScaleGrad.apply(x, scale)
