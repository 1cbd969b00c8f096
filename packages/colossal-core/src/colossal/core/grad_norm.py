"""The global gradient norm of a model whose parameters may be sharded (tensor parallel).

Each gradient is seen through the sharded-state protocol: the gradient of a parameter marked
with :func:`colossal.core.mark_sharded` is that parameter's part of a whole gradient, so it
contributes only its real elements (padding excluded) and the parts of its group are summed;
an unmarked (replicated) parameter's gradient is the same on every rank and counts once. The
parameters are grouped by their process group, so there is one all-reduce per group, whatever
the number of parameters.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

from colossal.core.comm import all_reduce, group_ranks
from colossal.core.sharded_state import shard_spec

logger = logging.getLogger(__name__)

__all__ = ["clip_grad_norm_", "grad_norm"]


def _params(params: torch.Tensor | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(params, torch.Tensor):
        return [params]
    out = list(params)
    for p in out:
        if not isinstance(p, torch.Tensor):
            raise TypeError(
                f"grad_norm takes tensors (model parameters), got {type(p).__name__}; pass "
                "model.parameters()"
            )
    return out


def _norm_type(norm_type: float | int | str) -> float:
    value = float(norm_type)
    if math.isnan(value) or value <= 0:
        raise ValueError(
            f"norm_type={norm_type!r} is not a norm; pass a positive number or float('inf')"
        )
    return value


def _reduce(total: torch.Tensor, grad: torch.Tensor, p: float) -> torch.Tensor:
    if grad.numel() == 0:
        return total
    values = grad.detach().to(total.dtype)
    if math.isinf(p):
        return torch.maximum(total, values.abs().max().to(total.device))
    return total + values.abs().pow(p).sum().to(total.device)


def grad_norm(
    params: torch.Tensor | Iterable[torch.Tensor], norm_type: float | int | str = 2.0
) -> torch.Tensor:
    """The ``norm_type`` norm of all gradients of ``params`` as one vector (collective).

    Every rank of every sharded parameter's group must call it with the same parameters in
    the same order (a parameter without a gradient still joins its group's all-reduce).

    Args:
        params: The parameters (e.g. ``model.parameters()``), or one tensor.
        norm_type: ``p`` of the p-norm; ``float("inf")`` (or ``"inf"``) for the max norm.

    Returns:
        A float32 scalar tensor, the same on every rank, on the gradients' device.

    Raises:
        ValueError: ``norm_type`` is not positive.
        TypeError: ``params`` holds something other than tensors.
    """
    p = _norm_type(norm_type)
    tensors = _params(params)
    grads = [t.grad for t in tensors if t.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    replicated = torch.zeros((), dtype=torch.float32, device=device)
    groups: dict[tuple[int, ...], tuple[dist.ProcessGroup | None, torch.Tensor]] = {}
    for t in tensors:
        spec = shard_spec(t)
        if spec is None:
            if t.grad is not None:
                replicated = _reduce(replicated, t.grad, p)
            continue
        key = group_ranks(spec.group) if dist.is_initialized() else ()
        group, total = groups.get(key, (spec.group, torch.zeros_like(replicated)))
        if t.grad is not None:
            total = _reduce(total, spec.part.real(t.grad), p)
        groups[key] = (group, total)
    result = replicated
    for group, total in groups.values():  # first-seen order: the same on every rank
        if dist.is_initialized():
            op = dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM
            all_reduce(total, op=op, group=group)
        result = torch.maximum(result, total) if math.isinf(p) else result + total
    return result if math.isinf(p) else result.pow(1.0 / p)


def clip_grad_norm_(
    params: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float | int | str = 2.0,
    eps: float = 1e-6,
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

    Returns:
        The norm before clipping (a float32 scalar tensor).

    Raises:
        ValueError: ``max_norm`` is negative or ``norm_type`` not positive.
    """
    if not max_norm >= 0:
        raise ValueError(f"max_norm={max_norm!r} must be >= 0; pass the largest allowed norm")
    tensors = _params(params)
    total = grad_norm(tensors, norm_type)
    coef = torch.clamp(max_norm / (total + eps), max=1.0)
    with torch.no_grad():
        for t in tensors:
            if t.grad is not None:
                t.grad.mul_(coef.to(device=t.grad.device, dtype=t.grad.dtype))
    return total
