"""Autograd-aware uneven all-to-all (through :mod:`colossal.core.comm`, so it is tracked)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from colossal.core import comm

__all__ = ["all_to_all_uneven", "exchange_counts"]


def _exchange(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup | None
) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    comm.all_to_all(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        ctx.splits = (out_splits, in_splits)
        ctx.group = group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group), None, None, None


def all_to_all_uneven(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Send ``x``'s rows ``in_splits[r]`` to rank ``r`` of ``group``, receive ``out_splits[r]``.

    The backward is the reverse all-to-all of the gradient (splits swapped).
    """
    result: torch.Tensor = _AllToAll.apply(x, list(out_splits), list(in_splits), group)
    return result


def exchange_counts(counts: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """One all-to-all of per-expert token counts.

    Args:
        counts: ``[E]`` tokens this rank sends to each global expert (experts laid out in
            contiguous blocks of ``E / ep`` per rank of ``group``).
        group: The expert-parallel group.

    Returns:
        ``[ep, E / ep]``: tokens each source rank sends to each of this rank's local experts.
    """
    ep = dist.get_world_size(group)
    out = torch.empty_like(counts)
    comm.all_to_all(out, counts.contiguous(), group=group)
    return out.reshape(ep, -1)
