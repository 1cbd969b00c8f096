"""SUMMA: the q-step block matrix products of 2D tensor parallelism (not differentiable).

Every rank ``(i, j)`` of the q x q grid holds block ``(i, j)`` of its operands. The seed
page's algorithm for ``C = A B``: at step ``t`` the block ``A_it`` is broadcast along row
``i`` from rank ``(i, t)``, ``B_tj`` along column ``j`` from rank ``(t, j)``, and every rank
adds their product to its block ``C_ij``. The two transposed forms the backward needs keep
one operand in place and *reduce* the product instead:

* :func:`summa_ab`:  ``C_ij = sum_t A_it B_tj``; broadcast A along the row, B along the
  column (``q`` broadcasts each).
* :func:`summa_abt`: ``C_it = sum_j A_ij B_tj^T``; broadcast B along the column, reduce the
  partial ``C_it`` along the row onto rank ``(i, t)`` (``q`` broadcasts, ``q`` reduces).
* :func:`summa_atb`: ``C_tj = sum_i A_it^T B_ij``; broadcast A along the row, reduce the
  partial ``C_tj`` along the column onto rank ``(t, j)`` (``q`` broadcasts, ``q`` reduces).

The block products are given as a function ``mm(a_block, b_block)``, so callers choose the
transposes of torch's ``(out, in)`` weights. Broadcasts run one step ahead of the products
(step ``t + 1`` is in flight while step ``t`` multiplies) and the reduces are waited on at
the end: two blocks of each operand are alive at a time, never a whole row or column. All
collectives go through :mod:`colossal.core.comm`, so the tracker counts them; a grid of one
rank communicates nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from colossal.core.comm import CommWork, broadcast, reduce
from colossal.shardformer.layer.tp2d._grid import Grid2D

__all__ = ["BlockStream", "Product", "Reductions", "summa_ab", "summa_abt", "summa_atb"]

Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``mm(a_block, b_block)``: the product of two blocks (transposes chosen by the caller)."""


class BlockStream:
    """The q blocks of a row or column, broadcast one by one from their holders.

    ``start(t)`` issues the asynchronous broadcast of step ``t`` (from ``sources[t]``; this
    rank sends ``local`` when it is the source), ``take(t)`` waits for it and returns the
    block. Every rank of ``group`` issues the same steps in the same order.

    Args:
        local: This rank's block (every rank's has the same shape).
        group: The row or column group.
        sources: Global rank holding the block of each step.
    """

    def __init__(
        self, local: torch.Tensor, group: dist.ProcessGroup, sources: tuple[int, ...]
    ) -> None:
        self.local = local.contiguous()
        self.group, self.sources = group, sources
        self.me = dist.get_rank()
        self._pending: dict[int, tuple[torch.Tensor, CommWork | None]] = {}

    def start(self, t: int) -> None:
        """Issue the broadcast of step ``t`` (no-op past the last step or when issued)."""
        if t >= len(self.sources) or t in self._pending:
            return
        src = self.sources[t]
        buf = self.local if src == self.me else torch.empty_like(self.local)
        work = broadcast(buf, src=src, group=self.group, async_op=True)
        self._pending[t] = (buf, work)

    def take(self, t: int) -> torch.Tensor:
        """The block of step ``t`` (issuing it first if needed)."""
        self.start(t)
        buf, work = self._pending.pop(t)
        if work is not None:
            work.wait()
        return buf


class Reductions:
    """Asynchronous reduces of partial products, step ``t`` onto ``targets[t]``.

    ``add(t, partial)`` issues the reduce of step ``t``; ``finish()`` waits for all and
    returns the sum reduced onto this rank.

    Args:
        group: The row or column group.
        targets: Global rank receiving the sum of each step.
    """

    def __init__(self, group: dist.ProcessGroup, targets: tuple[int, ...]) -> None:
        self.group, self.targets = group, targets
        self.me = dist.get_rank()
        self._works: list[tuple[torch.Tensor, CommWork | None]] = []
        self.mine: torch.Tensor | None = None

    def add(self, t: int, partial: torch.Tensor) -> None:
        """Issue the reduce of step ``t`` (``partial`` must not be used afterwards)."""
        partial = partial.contiguous()
        work = reduce(partial, dst=self.targets[t], group=self.group, async_op=True)
        self._works.append((partial, work))  # keeps the buffer alive until done
        if self.targets[t] == self.me:
            self.mine = partial

    def finish(self) -> torch.Tensor:
        """Wait for every reduce; this rank's summed block."""
        for _, work in self._works:
            if work is not None:
                work.wait()
        self._works.clear()
        assert self.mine is not None, "no step reduced onto this rank"
        return self.mine


def summa_ab(a: torch.Tensor, b: torch.Tensor, grid: Grid2D, mm: Product) -> torch.Tensor:
    """``C_ij = sum_t mm(A_it, B_tj)``: A broadcast along the row, B along the column."""
    if grid.q == 1:
        return mm(a, b)
    rows = BlockStream(a, grid.row_group, grid.row_ranks)
    cols = BlockStream(b, grid.col_group, grid.col_ranks)
    out: torch.Tensor | None = None
    for t in range(grid.q):
        rows.start(t)
        cols.start(t)
        rows.start(t + 1)
        cols.start(t + 1)
        part = mm(rows.take(t), cols.take(t))
        out = part if out is None else out.add_(part)
    assert out is not None
    return out


def summa_abt(a: torch.Tensor, b: torch.Tensor, grid: Grid2D, mm: Product) -> torch.Tensor:
    """``C_it = sum_j mm(A_ij, B_tj)``: B broadcast along the column, C reduced along the row.

    Returns this rank's block ``C_ij`` (the sum reduced onto it at step ``t = j``).
    """
    if grid.q == 1:
        return mm(a, b)
    cols = BlockStream(b, grid.col_group, grid.col_ranks)
    sums = Reductions(grid.row_group, grid.row_ranks)
    for t in range(grid.q):
        cols.start(t)
        cols.start(t + 1)
        sums.add(t, mm(a, cols.take(t)))
    return sums.finish()


def summa_atb(a: torch.Tensor, b: torch.Tensor, grid: Grid2D, mm: Product) -> torch.Tensor:
    """``C_tj = sum_i mm(A_it, B_ij)``: A broadcast along the row, C reduced along the column.

    Returns this rank's block ``C_ij`` (the sum reduced onto it at step ``t = i``).
    """
    if grid.q == 1:
        return mm(a, b)
    rows = BlockStream(a, grid.row_group, grid.row_ranks)
    sums = Reductions(grid.col_group, grid.col_ranks)
    for t in range(grid.q):
        rows.start(t)
        rows.start(t + 1)
        sums.add(t, mm(rows.take(t), b))
    return sums.finish()
