"""``Accuracy``: the number of correct top-1 predictions (ColossalAI's ``nn.metric.Accuracy``)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Accuracy", "calc_acc"]


def calc_acc(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """How many of ``argmax(logits, -1)`` equal ``targets`` (a 0-dim int64 tensor).

    Args:
        logits: Scores with the classes on the last dimension.
        targets: Class indices shaped like ``logits`` without its last dimension.

    Raises:
        ValueError: The shapes do not match.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"Accuracy: logits {tuple(logits.shape)} need targets of shape "
            f"{tuple(logits.shape[:-1])} (class indices), got {tuple(targets.shape)}"
        )
    return torch.sum(torch.argmax(logits, dim=-1) == targets)


class Accuracy(nn.Module):
    """Counts correct top-1 predictions; ``AccuracyHook`` divides by the number of samples.

    As ColossalAI's, the value is a count, not a ratio, so counts from several batches and
    data-parallel ranks add up. Without tensor parallelism (or with 1D, whose logits are
    whole on every rank) it is :func:`calc_acc`.

    Args:
        tensor_parallel: The tensor-parallel mode of the logits: None or ``"1d"``.

    Raises:
        NotImplementedError: A 2D/2.5D/3D mode (their logits are split over ranks).
    """

    def __init__(self, tensor_parallel: str | None = None) -> None:
        super().__init__()
        if tensor_parallel not in (None, "1d"):
            raise NotImplementedError(
                f"Accuracy(tensor_parallel={tensor_parallel!r}): only None and '1d' are "
                "supported; gather the logits first and use Accuracy()"
            )
        self.tensor_parallel = tensor_parallel

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The number of rows of ``logits`` whose arg-max equals ``targets``."""
        return calc_acc(logits, targets)
