"""Global gradient norm over sharded gradients: one local pass, one scalar all-reduce per group."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from colossal.core.comm import all_reduce


def local_norm_term(grads: Iterable[torch.Tensor], norm_type: float) -> torch.Tensor:
    """This rank's contribution: ``sum |g|^p`` (or ``max |g|`` for ``p = inf``), in fp32."""
    total = torch.zeros((), dtype=torch.float32)
    for g in grads:
        if g.numel() == 0:
            continue
        if math.isinf(norm_type):
            total = torch.maximum(total, g.abs().max().float().cpu())
        else:
            total += torch.linalg.vector_norm(g, norm_type, dtype=torch.float32).cpu() ** norm_type
    return total


def global_norm(
    term: torch.Tensor, norm_type: float, groups: Sequence[dist.ProcessGroup | None]
) -> float:
    """Combine every rank's :func:`local_norm_term` over ``groups`` and take the root.

    The result is ``inf`` or ``nan`` when any rank held a non-finite gradient, which doubles as
    the overflow check of fp16 training.
    """
    value = term.reshape(1).clone()
    op = ReduceOp.MAX if math.isinf(norm_type) else ReduceOp.SUM
    for group in groups:
        all_reduce(value, op=op, group=group)
    total = float(value.item())
    if math.isinf(norm_type) or not math.isfinite(total):
        return total
    return total ** (1.0 / norm_type)
