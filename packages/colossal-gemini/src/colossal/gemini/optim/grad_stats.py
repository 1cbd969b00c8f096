"""The overflow verdict and the global gradient norm of the chunks' gradient shards.

Every element of a trainable chunk's gradient lives in exactly one rank's gradient shard
(a kept-gathered chunk's gradient is all-reduced, but each rank's shard is only its own range
of it; padding is zero), so summing each rank's local term over the group counts every
gradient element once. Both answers travel in one all-reduce of two numbers: the overflow
flag and the norm term, with ``SUM`` for a p-norm and ``MAX`` for the max norm (a flag of
0 or 1 survives either).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from colossal.core.comm import all_reduce

logger = logging.getLogger(__name__)

__all__ = ["GradStats", "check_norm_type", "reduce_grad_stats"]


@dataclass(frozen=True)
class GradStats:
    """What the gradient shards of one step say, agreed over the group.

    Attributes:
        overflow: Some rank's gradient shard holds an inf or NaN.
        norm: The global ``norm_type`` norm of the gradients as they are (still multiplied by
            the loss scale); ``inf`` on overflow.
    """

    overflow: bool
    norm: float


def check_norm_type(norm_type: float) -> float:
    """``norm_type`` as a float, validated.

    Raises:
        ValueError: It is not a positive number or ``inf``.
    """
    if isinstance(norm_type, bool):
        raise ValueError(f"norm_type={norm_type!r} is not a norm; pass e.g. 2.0 or float('inf')")
    try:
        value = float(norm_type)
    except (TypeError, ValueError):
        raise ValueError(
            f"norm_type={norm_type!r} is not a norm; pass e.g. 2.0 or float('inf')"
        ) from None
    if math.isnan(value) or value <= 0:
        raise ValueError(f"norm_type={norm_type!r} is not a norm; pass e.g. 2.0 or float('inf')")
    return value


def _local_terms(
    grads: Iterable[torch.Tensor], p: float, device: torch.device
) -> tuple[bool, float]:
    """(any inf/NaN here, sum of |g|^p or max |g|) in one pass over each shard."""
    norms = [torch.linalg.vector_norm(g.detach(), p, dtype=torch.float32).to(device)
             for g in grads if g.numel()]
    if not norms:
        return False, 0.0
    stacked = torch.stack(norms).to(torch.float64)
    if not bool(torch.isfinite(stacked).all()):
        return True, math.inf
    term = stacked.max() if math.isinf(p) else stacked.pow(p).sum()
    return False, float(term)


def reduce_grad_stats(
    grads: Iterable[torch.Tensor],
    norm_type: float,
    group: ProcessGroup | None,
    device: torch.device,
) -> GradStats:
    """The overflow verdict and global norm of ``grads`` (this rank's gradient shards).

    Collective over ``group`` (one all-reduce of two float64 numbers on ``device``; none
    when torch.distributed is not initialized or the group has one rank): every rank must
    call it, whatever it holds.

    Args:
        grads: This rank's gradient shards.
        norm_type: ``p`` of the p-norm (``inf``: the max norm).
        group: The data-parallel group of the chunks.
        device: Where the collective's tensor lives (the accelerator's current device).
    """
    p = check_norm_type(norm_type)
    overflow, term = _local_terms(grads, p, device)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        local = [1.0, 0.0] if overflow else [0.0, term]
        both = torch.tensor(local, dtype=torch.float64, device=device)
        all_reduce(both, op=ReduceOp.MAX if math.isinf(p) else ReduceOp.SUM, group=group)
        flag, term = both.tolist()
        overflow = flag > 0
    if overflow or not math.isfinite(term):
        return GradStats(True, math.inf)
    return GradStats(False, term if math.isinf(p) else term ** (1.0 / p))
