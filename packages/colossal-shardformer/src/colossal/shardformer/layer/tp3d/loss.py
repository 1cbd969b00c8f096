"""Cross entropy of 3D logits: every class per rank, or the vocabulary split over the cube.

* :func:`cross_entropy_3d`: logits of a :class:`~.linear.Classifier3D` (this rank's rows,
  every class, the same on every rank of the output axis). The loss of the rows is local;
  the mean over the whole batch takes one all-reduce of ``(sum, count)`` over the input and
  weight axes.
* :func:`vocab_parallel_cross_entropy_3d`: logits of a
  :class:`~.linear.VocabParallelClassifier3D` (this rank's rows, classes split along the
  output axis of the logits' orientation). Per row, the max and the sum of exponentials
  come from all-reduces over the output axis
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
from colossal.shardformer.layer.tp3d._cube import Cube3D
from colossal.shardformer.layer.tp3d._primitives import (
    batch_mean,
    reduce_forward,
    split_rows_cols,
)

__all__ = [
    "CrossEntropyLoss3D",
    "VocabParallelCrossEntropyLoss3D",
    "cross_entropy_3d",
    "vocab_parallel_cross_entropy_3d",
]

_REDUCTIONS = ("mean", "sum", "none")


def _local_targets(
    targets: torch.Tensor, logits: torch.Tensor, cube: Cube3D, name: str
) -> torch.Tensor:
    rows, q = logits.shape[0], cube.depth
    if tuple(targets.shape[1:]) != tuple(logits.shape[1:-1]):
        raise ValueError(
            f"{name}: targets {tuple(targets.shape)} and logits {tuple(logits.shape)} must "
            "agree on every dim but the batch and the class dims"
        )
    if targets.shape[0] == rows:
        return targets
    if targets.shape[0] == rows * q * q:
        return split_rows_cols(targets, cube, rows=True, cols=False)
    raise ValueError(
        f"{name}: targets hold {targets.shape[0]} rows; pass the whole batch "
        f"({rows * q * q} rows) or this rank's rows ({rows})"
    )


def _reduce(
    losses: torch.Tensor, targets: torch.Tensor, ignore_index: int, reduction: str, cube: Cube3D
) -> torch.Tensor:
    if reduction == "none":
        return losses.reshape(targets.shape)
    rows = cube.group("input", "weight")
    if reduction == "sum":
        return reduce_forward(losses.sum(), rows)
    return batch_mean(losses.sum(), (targets != ignore_index).sum(), rows)


def _check_reduction(reduction: str) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")


def cross_entropy_3d(
    logits: torch.Tensor,
    targets: torch.Tensor,
    dims: ParallelDims,
    swapped: bool = False,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """``F.cross_entropy`` of the whole batch from :class:`~.linear.Classifier3D` logits.

    Args:
        logits: ``(n, ..., C)``: this rank's rows, every class.
        targets: Class ids, the whole batch ``(n q^2, ...)`` or this rank's rows ``(n, ...)``.
        dims: The job's layout, ``tp_mode="3d"``.
        swapped: Orientation of the logits' rows (the classifier's ``output_swapped``).
        ignore_index: Targets with this value add nothing to the loss nor the count.
        reduction: ``"mean"`` over the non-ignored targets of the whole batch, ``"sum"``, or
            ``"none"`` (this rank's per-row losses).
        label_smoothing: As ``F.cross_entropy``'s.

    Raises:
        ValueError: Shapes disagree or an unknown reduction.
    """
    _check_reduction(reduction)
    cube = Cube3D(dims, swapped)
    local = _local_targets(targets, logits, cube, "cross_entropy_3d")
    losses = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        local.reshape(-1),
        ignore_index=ignore_index,
        reduction="none",
        label_smoothing=label_smoothing,
    )
    return _reduce(losses, local, ignore_index, reduction, cube)


def vocab_parallel_cross_entropy_3d(
    logits: torch.Tensor,
    targets: torch.Tensor,
    dims: ParallelDims,
    swapped: bool = False,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross entropy of the whole batch from :class:`~.linear.VocabParallelClassifier3D` logits.

    Args:
        logits: ``(n, ..., C/q)``: this rank's rows and classes block ``output`` (the
            output axis of the logits' orientation ``swapped``).
        targets: Class ids, the whole batch or this rank's rows.
        dims: The job's layout, ``tp_mode="3d"``.
        swapped: Orientation of the logits (the classifier's ``output_swapped``).
        ignore_index: Targets with this value add nothing to the loss nor the count.
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` (this rank's per-row losses).

    Raises:
        ValueError: Shapes disagree or an unknown reduction.
    """
    _check_reduction(reduction)
    cube = Cube3D(dims, swapped)
    local = _local_targets(targets, logits, cube, "vocab_parallel_cross_entropy_3d")
    losses = cross_entropy_1d(
        logits.float(), local, cube.group("output"), ignore_index=ignore_index, reduction="none"
    )
    return _reduce(losses.reshape(-1), local, ignore_index, reduction, cube)


class CrossEntropyLoss3D(nn.Module):
    """:func:`cross_entropy_3d` as a module.

    Args:
        dims: The job's layout, ``tp_mode="3d"``.
        swapped: Orientation of the logits' rows.
        ignore_index: Target value to ignore.
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.
        label_smoothing: As ``nn.CrossEntropyLoss``'s.
    """

    def __init__(
        self,
        *,
        dims: ParallelDims,
        swapped: bool = False,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__()
        _check_reduction(reduction)
        Cube3D(dims, swapped)  # validates dims
        self.dims, self.swapped = dims, swapped
        self.ignore_index, self.reduction = ignore_index, reduction
        self.label_smoothing = label_smoothing

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of the whole batch (the same on every rank)."""
        return cross_entropy_3d(
            logits,
            targets,
            self.dims,
            self.swapped,
            self.ignore_index,
            self.reduction,
            self.label_smoothing,
        )


class VocabParallelCrossEntropyLoss3D(nn.Module):
    """:func:`vocab_parallel_cross_entropy_3d` as a module.

    Args:
        dims: The job's layout, ``tp_mode="3d"``.
        swapped: Orientation of the logits (the classifier's ``output_swapped``).
        ignore_index: Target value to ignore.
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.
    """

    def __init__(
        self,
        *,
        dims: ParallelDims,
        swapped: bool = False,
        ignore_index: int = -100,
        reduction: str = "mean",
    ) -> None:
        super().__init__()
        _check_reduction(reduction)
        Cube3D(dims, swapped)
        self.dims, self.swapped = dims, swapped
        self.ignore_index, self.reduction = ignore_index, reduction

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of the whole batch (the same on every rank)."""
        return vocab_parallel_cross_entropy_3d(
            logits, targets, self.dims, self.swapped, self.ignore_index, self.reduction
        )
