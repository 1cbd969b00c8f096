"""Cross entropy of 2.5D logits: every class per rank, or the vocabulary split over the row.

* :func:`cross_entropy_2p5d`: logits of a :class:`~.linear.Classifier2p5D` (this rank's rows,
  every class, the same on every rank of the row group). The loss of the rows is local; the
  mean over the whole batch takes one all-reduce of ``(sum, count)`` over the depth and the
  column (the ``d*q`` ranks holding different rows).
* :func:`vocab_parallel_cross_entropy_2p5d`: logits of a
  :class:`~.linear.VocabParallelClassifier2p5D` (this rank's rows, classes block ``j``). Per
  row, the max and the sum of exponentials come from all-reduces over the row group
  (:func:`~colossal.shardformer.layer.cross_entropy_1d`), never from gathering the logits;
  then the same mean over the batch.

Targets may be the whole batch (``(batch, ...)``, the same on every rank; each rank keeps its
rows) or already this rank's rows. The result is the same on every rank, so every rank calls
``backward`` on it and receives the gradient of its own logits only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812 - the usual alias
from torch import nn

from colossal.core import ParallelDims
from colossal.shardformer.layer.loss import cross_entropy_1d
from colossal.shardformer.layer.tp2p5d._grid import Grid2p5D
from colossal.shardformer.layer.tp2p5d._primitives import (
    batch_mean,
    reduce_forward,
    split_rows_cols,
)

__all__ = [
    "CrossEntropyLoss2p5D",
    "VocabParallelCrossEntropyLoss2p5D",
    "cross_entropy_2p5d",
    "vocab_parallel_cross_entropy_2p5d",
]

_REDUCTIONS = ("mean", "sum", "none")


def _local_targets(
    targets: torch.Tensor, logits: torch.Tensor, grid: Grid2p5D, name: str
) -> torch.Tensor:
    rows, parts = logits.shape[0], grid.row_blocks
    if tuple(targets.shape[1:]) != tuple(logits.shape[1:-1]):
        raise ValueError(
            f"{name}: targets {tuple(targets.shape)} and logits {tuple(logits.shape)} must "
            "agree on every dim but the batch and the class dims"
        )
    if targets.shape[0] == rows:
        return targets
    if targets.shape[0] == rows * parts:
        return split_rows_cols(targets, grid, rows=True, cols=False)
    raise ValueError(
        f"{name}: targets hold {targets.shape[0]} rows; pass the whole batch "
        f"({rows * parts} rows) or this rank's rows ({rows})"
    )


def _reduce(
    losses: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    reduction: str,
    grid: Grid2p5D,
) -> torch.Tensor:
    if reduction == "none":
        return losses.reshape(targets.shape)
    rows = grid.group("dep", "col")
    if reduction == "sum":
        return reduce_forward(losses.sum(), rows)
    return batch_mean(losses.sum(), (targets != ignore_index).sum(), rows)


def _check_reduction(reduction: str) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")


def cross_entropy_2p5d(
    logits: torch.Tensor,
    targets: torch.Tensor,
    dims: ParallelDims,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """``F.cross_entropy`` of the whole batch from :class:`~.linear.Classifier2p5D` logits.

    Args:
        logits: ``(n, ..., C)``: this rank's rows, every class.
        targets: Class ids, the whole batch ``(n d q, ...)`` or this rank's rows ``(n, ...)``.
        dims: The job's layout, ``tp_mode="2.5d"``.
        ignore_index: Targets with this value add nothing to the loss nor the count.
        reduction: ``"mean"`` over the non-ignored targets of the whole batch, ``"sum"``, or
            ``"none"`` (this rank's per-row losses).
        label_smoothing: As ``F.cross_entropy``'s.

    Raises:
        ValueError: Shapes disagree or an unknown reduction.
    """
    _check_reduction(reduction)
    grid = Grid2p5D(dims)
    local = _local_targets(targets, logits, grid, "cross_entropy_2p5d")
    losses = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        local.reshape(-1),
        ignore_index=ignore_index,
        reduction="none",
        label_smoothing=label_smoothing,
    )
    return _reduce(losses, local, ignore_index, reduction, grid)


def vocab_parallel_cross_entropy_2p5d(
    logits: torch.Tensor,
    targets: torch.Tensor,
    dims: ParallelDims,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross entropy of the whole batch from :class:`~.linear.VocabParallelClassifier2p5D` logits.

    Args:
        logits: ``(n, ..., C/q)``: this rank's rows and classes block ``j``.
        targets: Class ids, the whole batch or this rank's rows.
        dims: The job's layout, ``tp_mode="2.5d"``.
        ignore_index: Targets with this value add nothing to the loss nor the count.
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` (this rank's per-row losses).

    Raises:
        ValueError: Shapes disagree or an unknown reduction.
    """
    _check_reduction(reduction)
    grid = Grid2p5D(dims)
    local = _local_targets(targets, logits, grid, "vocab_parallel_cross_entropy_2p5d")
    losses = cross_entropy_1d(
        logits.float(), local, grid.group("row"), ignore_index=ignore_index, reduction="none"
    )
    return _reduce(losses.reshape(-1), local, ignore_index, reduction, grid)


class CrossEntropyLoss2p5D(nn.Module):
    """:func:`cross_entropy_2p5d` as a module.

    Args:
        dims: The job's layout, ``tp_mode="2.5d"``.
        ignore_index: Target value to ignore.
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.
        label_smoothing: As ``nn.CrossEntropyLoss``'s.
    """

    def __init__(
        self,
        *,
        dims: ParallelDims,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__()
        _check_reduction(reduction)
        Grid2p5D(dims)  # validates dims
        self.dims = dims
        self.ignore_index, self.reduction = ignore_index, reduction
        self.label_smoothing = label_smoothing

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of the whole batch (the same on every rank)."""
        return cross_entropy_2p5d(
            logits, targets, self.dims, self.ignore_index, self.reduction, self.label_smoothing
        )


class VocabParallelCrossEntropyLoss2p5D(nn.Module):
    """:func:`vocab_parallel_cross_entropy_2p5d` as a module.

    Args:
        dims: The job's layout, ``tp_mode="2.5d"``.
        ignore_index: Target value to ignore.
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.
    """

    def __init__(
        self, *, dims: ParallelDims, ignore_index: int = -100, reduction: str = "mean"
    ) -> None:
        super().__init__()
        _check_reduction(reduction)
        Grid2p5D(dims)
        self.dims = dims
        self.ignore_index, self.reduction = ignore_index, reduction

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of the whole batch (the same on every rank)."""
        return vocab_parallel_cross_entropy_2p5d(
            logits, targets, self.dims, self.ignore_index, self.reduction
        )
