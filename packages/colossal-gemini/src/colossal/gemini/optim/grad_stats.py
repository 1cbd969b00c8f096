"""The overflow verdict and the global gradient norm of the chunks' gradient shards.

Every element of a trainable chunk's gradient lives in exactly one rank's gradient shard
(a kept-gathered chunk's gradient is all-reduced, but each rank's shard is only its own range
of it; padding is zero), so summing each rank's local term over the group counts every
gradient element once. Both answers travel in one all-reduce of two numbers: the overflow
flag and the norm term, with ``SUM`` for a p-norm and ``MAX`` for the max norm (a flag of
0 or 1 survives either).

When the model is also split over other ranks (tensor parallelism: each rank's chunks hold
its part of the split parameters), the same two numbers are then reduced over each extra
group, so the verdict and the norm cover the whole job. A gradient held alike by several
ranks of an extra group (a parameter replicated over the tensor-parallel group) must be
counted by one of them only: the others pass it as ``uncounted``, checked for inf/NaN but
left out of the norm.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from colossal.core.comm import all_reduce

logger = logging.getLogger(__name__)

__all__ = ["GradStats", "check_norm_type", "norm_pieces", "reduce_grad_stats"]


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


def _norms(grads: Iterable[torch.Tensor], p: float, device: torch.device) -> list[torch.Tensor]:
    return [torch.linalg.vector_norm(g.detach(), p, dtype=torch.float32).to(device)
            for g in grads if g.numel()]


def _local_terms(
    grads: Iterable[torch.Tensor],
    p: float,
    device: torch.device,
    uncounted: Iterable[torch.Tensor] = (),
) -> tuple[bool, float]:
    """(any inf/NaN here, sum of |g|^p or max |g| over ``grads``) in one pass over each piece.

    ``uncounted`` pieces are only checked for inf/NaN.
    """
    counted = _norms(grads, p, device)
    checked = _norms(uncounted, p, device)
    if not counted and not checked:
        return False, 0.0
    every = torch.stack(counted + checked).to(torch.float64)
    if not bool(torch.isfinite(every).all()):
        return True, math.inf
    if not counted:
        return False, 0.0
    stacked = every[: len(counted)]
    term = stacked.max() if math.isinf(p) else stacked.pow(p).sum()
    return False, float(term)


def reduce_grad_stats(
    grads: Iterable[torch.Tensor],
    norm_type: float,
    group: ProcessGroup | None,
    device: torch.device,
    *,
    uncounted: Iterable[torch.Tensor] = (),
    extra_groups: Sequence[ProcessGroup | None] = (),
) -> GradStats:
    """The overflow verdict and global norm of ``grads`` (this rank's gradient shards).

    Collective over ``group`` and then each of ``extra_groups`` (one all-reduce of two
    float64 numbers on ``device`` per group with more than one rank; none without
    torch.distributed): every rank must call it, whatever it holds.

    Args:
        grads: This rank's gradient shards (or pieces of them) counted in the norm.
        norm_type: ``p`` of the p-norm (``inf``: the max norm).
        group: The data-parallel group of the chunks.
        device: Where the collective's tensor lives (the accelerator's current device).
        uncounted: Pieces checked for inf/NaN only (another rank of an extra group counts
            them).
        extra_groups: Further groups the verdict and the norm are reduced over (e.g. the
            tensor-parallel group), in the same order on every rank.
    """
    p = check_norm_type(norm_type)
    overflow, term = _local_terms(grads, p, device, uncounted)
    groups = [g for g in (group, *extra_groups)
              if dist.is_initialized() and dist.get_world_size(g) > 1]
    if groups:
        local = [1.0, 0.0] if overflow else [0.0, term]
        both = torch.tensor(local, dtype=torch.float64, device=device)
        for g in groups:
            all_reduce(both, op=ReduceOp.MAX if math.isinf(p) else ReduceOp.SUM, group=g)
        flag, term = both.tolist()
        overflow = flag > 0
    if overflow or not math.isfinite(term):
        return GradStats(True, math.inf)
    return GradStats(False, term if math.isinf(p) else term ** (1.0 / p))


def norm_pieces(
    chunks: Iterable[Any], excluded: Collection[int]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """This rank's gradient shards split into pieces counted in the norm and uncounted ones.

    A chunk none of whose parameters is excluded is one counted piece; in the others, each
    run of consecutive parameters with the same verdict is one piece of the shard (padding,
    which is zero, goes with the run before it, or the first run).

    Args:
        chunks: Trainable chunks (their ``grad_shard``; chunks without one are skipped).
        excluded: ``id()`` of the parameters left out of this rank's share of the norm.

    Returns:
        ``(counted, uncounted)`` views of the gradient shards.
    """
    counted: list[torch.Tensor] = []
    uncounted: list[torch.Tensor] = []
    for chunk in chunks:
        grad = chunk.grad_shard
        if grad is None:
            continue
        if not any(id(p) in excluded for p in chunk.params):
            counted.append(grad)
            continue
        lo, hi = chunk.shard_begin, chunk.shard_end
        # Runs of parameters with one verdict: (first element in the shard, counted).
        runs: list[tuple[int, bool]] = []
        for p, info in sorted(chunk.infos.items(), key=lambda kv: kv[1].offset):
            keep = id(p) not in excluded
            if info.end > lo and info.offset < hi and (not runs or runs[-1][1] != keep):
                runs.append((max(info.offset - lo, 0) if runs else 0, keep))
        if not runs:
            counted.append(grad)  # only padding here (zeros)
            continue
        for (start, keep), stop in zip(runs, [s for s, _ in runs[1:]] + [hi - lo],
                                       strict=True):
            (counted if keep else uncounted).append(grad[start:stop])
    return counted, uncounted
