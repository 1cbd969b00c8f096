"""The one global gradient norm: each element of the logical model counts exactly once.

Every gradient is seen through its placements (:mod:`colossal.core.sharded`): a piece of a
tensor split along an axis (tensor parallel block, ZeRO or Gemini flat range, expert slice)
counts its real elements (padding never); a piece replicated along an axis counts on the
axis' first rank only; a piece owned by one rank of an axis (a pipeline stage's parameter)
counts there. So the shares of all ranks add up to the norm of the unsharded model, and one
all-reduce of one scalar over the job (``group``) gives it to every rank, whatever the
parameters and however many axes split them.

ZeRO, Gemini, FSDP2, the hybrid plugin and the plain wrappers all compute their norm here:
:func:`grad_norm` / :func:`clip_grad_norm_` for parameters whose ``.grad`` is laid out like
the parameter, :func:`norm_share` + :func:`reduce_norm` for optimizers that keep gradient
pieces of their own (each described once by a :class:`NormTerm`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from colossal.core.comm import all_reduce
from colossal.core.sharded import (
    LocalPart,
    Owned,
    Placement,
    Replicate,
    ShardedTensor,
    compose,
    shard_spec,
)
from colossal.core.sharded.gather import axis_ranks, this_rank

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

logger = logging.getLogger(__name__)

__all__ = [
    "NormTerm",
    "clip_grad_norm_",
    "grad_norm",
    "norm_share",
    "norm_term",
    "reduce_norm",
]


@dataclass(frozen=True)
class NormTerm:
    """How a rank's piece of a tensor counts in the global norm.

    Attributes:
        part: The piece's part of the whole tensor (``real`` drops its padding); None when
            the piece is the whole tensor.
        counted: Whether this rank's piece counts (False where another rank of a replicated
            axis counts the same elements).
    """

    part: LocalPart | None
    counted: bool


def counts_here(placements: Sequence[Placement], group: dist.ProcessGroup | None = None) -> bool:
    """Whether this rank counts its piece: first rank of every replicated axis, the owner.

    A tensor without placements is replicated over ``group`` (the job when None) and counts
    on the group's first rank.
    """
    me = this_rank()
    if not placements:
        return not dist.is_initialized() or axis_ranks(group)[0] == me
    for placement in placements:
        ranks = axis_ranks(placement.group)
        if isinstance(placement.part, Replicate) and ranks[0] != me:
            return False
        if isinstance(placement.part, Owned) and ranks[placement.part.owner] != me:
            return False
    return True


def norm_term(
    placements: Sequence[Placement],
    shape: Sequence[int],
    group: dist.ProcessGroup | None = None,
) -> NormTerm:
    """The :class:`NormTerm` of a piece placed by ``placements`` of a tensor of ``shape``.

    Args:
        placements: The piece's placements, outermost first (none: replicated over ``group``).
        shape: The whole tensor's shape.
        group: The job the norm is reduced over (for tensors without placements).
    """
    part = compose(placements, shape) if any(p.splits for p in placements) else None
    return NormTerm(part, counts_here(placements, group))


def _norm_type(norm_type: float | int | str) -> float:
    value = float(norm_type)
    if math.isnan(value) or value <= 0:
        raise ValueError(
            f"norm_type={norm_type!r} is not a norm; pass a positive number or float('inf')"
        )
    return value


def norm_share(
    pieces: Iterable[tuple[torch.Tensor, NormTerm]],
    norm_type: float | int | str = 2.0,
    device: torch.device | None = None,
) -> torch.Tensor:
    """This rank's share of the global norm: sum of ``|x|^p`` (max for inf) of counted pieces.

    Args:
        pieces: ``(values, term)``: a piece's local tensor and how it counts.
        norm_type: ``p`` of the p-norm; ``float("inf")`` for the max norm.
        device: Where the share lives (default: the first piece's device, else the CPU).

    Pieces another rank counts are still checked: an inf or NaN in any piece makes the share
    non-finite (the fp16 overflow verdict sees every gradient this rank holds).

    Returns:
        A float32 scalar tensor (not yet reduced over the job: see :func:`reduce_norm`).
    """
    p = _norm_type(norm_type)
    real: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    others: list[torch.Tensor] = []  # counted elsewhere: only checked for inf/NaN
    for values, term in pieces:
        piece = values if term.part is None else term.part.real(values)
        if not piece.numel():
            continue
        if term.counted:
            real.setdefault((piece.device, piece.dtype), []).append(piece.detach())
        else:
            others.append(piece.detach())
    if device is None:
        device = next(iter(real))[0] if real else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=device)
    for tensors in real.values():
        norms = torch._foreach_norm(tensors, p)
        stacked = torch.stack([n.to(device=device, dtype=torch.float32) for n in norms])
        if math.isinf(p):
            total = torch.maximum(total, stacked.max())
        else:
            total = total + stacked.pow(p).sum()
    if others:
        checked = torch.stack([n.to(device=device, dtype=torch.float32)
                               for n in torch._foreach_norm(others, p)])
        total = total + (checked.sum() * 0)  # an inf/NaN anywhere makes the share non-finite
    return total


_NO_GROUP: Any = object()
"""``reduce_norm``'s group when the share is already the whole norm (no communication)."""


def reduce_norm(
    share: torch.Tensor, norm_type: float | int | str = 2.0,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The global norm from every rank's :func:`norm_share` (collective over ``group``).

    Args:
        share: This rank's share.
        norm_type: ``p`` of the p-norm.
        group: The job: every rank holding a part of the model (None: every rank).
    """
    p = _norm_type(norm_type)
    total = share.clone()
    if group is not _NO_GROUP and dist.is_initialized() and dist.get_world_size(group) > 1:
        all_reduce(total, op=dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM,
                   group=group)
    return total if math.isinf(p) else total.pow(1.0 / p)


def _params(params: torch.Tensor | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(params, torch.Tensor):
        return [params]
    out = list(params)
    for p in out:
        if not isinstance(p, torch.Tensor) and not isinstance(p, ShardedTensor):
            raise TypeError(
                f"grad_norm takes tensors (model parameters), got {type(p).__name__}; pass "
                "model.parameters()"
            )
    return out


def _grad_placements(
    tensors: Sequence[torch.Tensor],
) -> list[tuple[torch.Tensor, tuple[Placement, ...], Sequence[int]]]:
    """``(local gradient, placements, whole shape)`` of every tensor with a gradient."""
    out: list[tuple[torch.Tensor, tuple[Placement, ...], Sequence[int]]] = []
    for t in tensors:
        grad = t.grad
        if grad is None:
            continue
        local = getattr(grad, "_local_tensor", None)  # a DTensor gradient (FSDP2)
        if local is not None:
            from colossal.core.sharded.dtensor import dtensor_placements

            out.append((local, dtensor_placements(cast("DTensor", grad)), grad.shape))
            continue
        spec = shard_spec(t)
        if spec is None:
            out.append((grad, (), grad.shape))
        else:
            out.append((grad, spec.placements, spec.shape))
    return out


def grad_norm(
    params: torch.Tensor | Iterable[torch.Tensor], norm_type: float | int | str = 2.0,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The ``norm_type`` norm of all gradients of ``params`` as one vector (collective).

    A parameter's placements come from its :func:`colossal.core.mark_sharded` record (or its
    ``DTensor`` placements); one without is replicated over ``group``. When no parameter has
    placements the norm is computed locally (it is the same on every rank); otherwise every
    rank of ``group`` calls it (a rank without gradients too), and all of them agree on
    whether some parameter has placements.

    Args:
        params: The parameters (e.g. ``model.parameters()``), or one tensor.
        norm_type: ``p`` of the p-norm; ``float("inf")`` (or ``"inf"``) for the max norm.
        group: The ranks holding the model (None: every rank).

    Returns:
        A float32 scalar tensor, the same on every rank, on the gradients' device.

    Raises:
        ValueError: ``norm_type`` is not positive.
        TypeError: ``params`` holds something other than tensors.
    """
    p = _norm_type(norm_type)
    grads = _grad_placements(_params(params))
    if not any(placements for _, placements, _ in grads):  # replicated: the same everywhere
        return reduce_norm(norm_share(((g, NormTerm(None, True)) for g, _, _ in grads), p), p,
                           _NO_GROUP)
    pieces = ((g, norm_term(placements, shape, group)) for g, placements, shape in grads)
    return reduce_norm(norm_share(pieces, p), p, group)


def clip_grad_norm_(
    params: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float | int | str = 2.0,
    eps: float = 1e-6,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Scale the gradients of ``params`` in place so their global norm is at most ``max_norm``.

    Like ``torch.nn.utils.clip_grad_norm_`` over the whole (unsharded) model: the norm is
    :func:`grad_norm`, and every gradient is multiplied by ``min(1, max_norm / (norm + eps))``.
    Collective, as :func:`grad_norm`.

    Args:
        params: The parameters (e.g. ``model.parameters()``), or one tensor.
        max_norm: The largest allowed norm.
        norm_type: ``p`` of the p-norm; ``float("inf")`` for the max norm.
        eps: Added to the norm before dividing.
        group: The ranks holding the model (None: every rank).

    Returns:
        The norm before clipping (a float32 scalar tensor).

    Raises:
        ValueError: ``max_norm`` is negative or ``norm_type`` not positive.
    """
    if not max_norm >= 0:
        raise ValueError(f"max_norm={max_norm!r} must be >= 0; pass the largest allowed norm")
    tensors = _params(params)
    total = grad_norm(tensors, norm_type, group)
    coef = torch.clamp(max_norm / (total + eps), max=1.0)
    with torch.no_grad():
        for t in tensors:
            if t.grad is not None:
                grad = t.grad
                local = getattr(grad, "_local_tensor", None)
                target = local if local is not None else grad
                target.mul_(coef.to(device=target.device, dtype=target.dtype))
    return total
