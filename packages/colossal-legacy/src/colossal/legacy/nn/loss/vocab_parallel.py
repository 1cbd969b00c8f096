"""``VocabParallelCrossEntropyLoss``: cross entropy of logits whose classes are split."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from colossal.legacy.context import ParallelMode
from colossal.legacy.core import gpc
from colossal.legacy.nn.loss.cross_entropy import _grid_loss_kwargs, torch_reduction
from colossal.shardformer.layer import (
    VocabParallelCrossEntropyLoss2D,
    VocabParallelCrossEntropyLoss2p5D,
    VocabParallelCrossEntropyLoss3D,
    cross_entropy_1d,
)

__all__ = ["VocabParallelCrossEntropyLoss"]


class VocabParallelCrossEntropyLoss(nn.Module):
    """Cross entropy of a ``colossalai.nn.VocabParallelClassifier``'s logits, by mode.

    * None, ``'sequence'``: :class:`torch.nn.CrossEntropyLoss` (the logits hold every class).
    * ``'1d'``: the logits hold this rank's classes and the targets are whole; the max and
      the sum of exponentials come from all-reduces over the 1D group
      (:func:`colossal.shardformer.layer.cross_entropy_1d`).
    * ``'2d'`` / ``'2.5d'`` / ``'3d'``: ``VocabParallelCrossEntropyLoss2D`` / ``2p5D`` /
      ``3D`` (this rank's rows and classes; whole-batch targets). Build it after the model
      in ``'3d'`` (the logits' orientation is the one the classifier left).

    Args:
        reduction: True/False (ColossalAI's mean/none) or ``'mean'``/``'sum'``/``'none'``.
        *args: Further torch arguments (None and ``'sequence'`` only).
        **kwargs: ``ignore_index`` (every mode); torch's others without tensor parallelism.

    Raises:
        NotImplementedError: Arguments the mode's loss does not take, or a custom mode.
    """

    def __init__(self, reduction: bool | str = True, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        mode = gpc.tensor_parallel_mode
        self.reduction = torch_reduction(reduction)
        kwargs["reduction"] = self.reduction
        self.loss: nn.Module | None = None
        if mode in (None, "sequence"):
            self.loss = nn.CrossEntropyLoss(*args, **kwargs)
            return
        if mode == "1d":
            _grid_loss_kwargs(
                "VocabParallelCrossEntropyLoss", args, kwargs, ("reduction", "ignore_index")
            )
            self.ignore_index = int(kwargs.get("ignore_index", -100))
            return
        grid = {
            "2d": VocabParallelCrossEntropyLoss2D,
            "2.5d": VocabParallelCrossEntropyLoss2p5D,
            "3d": VocabParallelCrossEntropyLoss3D,
        }
        if mode not in grid:
            raise NotImplementedError(
                f"VocabParallelCrossEntropyLoss has no loss for tensor mode {mode!r}"
            )
        allowed = ("reduction", "ignore_index")
        self.loss = grid[mode](
            **_grid_loss_kwargs("VocabParallelCrossEntropyLoss", args, kwargs, allowed)
        )

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of ``logits`` (this rank's classes) against whole ``targets``."""
        if self.loss is not None:
            return self.loss(logits, targets)
        group = gpc.get_group(ParallelMode.PARALLEL_1D)
        return cross_entropy_1d(logits, targets, group, self.ignore_index, reduction=self.reduction)
