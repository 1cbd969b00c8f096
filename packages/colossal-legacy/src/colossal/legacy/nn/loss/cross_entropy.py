"""``CrossEntropyLoss`` of ColossalAI's ``colossalai.nn``: torch's loss, by the tensor mode."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from colossal.legacy.core import gpc

__all__ = ["CrossEntropyLoss"]

_REDUCTIONS = ("mean", "sum", "none")


def _reduction(reduction: bool | str) -> str:
    if isinstance(reduction, bool):
        return "mean" if reduction else "none"
    if reduction not in _REDUCTIONS:
        raise ValueError(
            f"CrossEntropyLoss: reduction={reduction!r} must be True (mean), False (none) "
            f"or one of {_REDUCTIONS}"
        )
    return reduction


class CrossEntropyLoss(nn.Module):
    """Cross entropy for the config's tensor-parallel mode.

    Without tensor parallelism, and with ``'1d'`` or ``'sequence'`` (whose logits are whole
    on every rank), it is :class:`torch.nn.CrossEntropyLoss`. As in ColossalAI,
    ``reduction`` is a bool (True: ``'mean'``, False: ``'none'``); torch's names work too.

    Args:
        reduction: True/False or ``'mean'``/``'sum'``/``'none'``.
        *args: Further :class:`torch.nn.CrossEntropyLoss` arguments (``weight``...).
        **kwargs: Further :class:`torch.nn.CrossEntropyLoss` arguments
            (``ignore_index``, ``label_smoothing``...).

    Raises:
        ValueError: An unknown reduction.
        NotImplementedError: The config's tensor mode is 2D, 2.5D or 3D.
    """

    def __init__(self, reduction: bool | str = True, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        mode = gpc.tensor_parallel_mode
        if mode not in (None, "1d", "sequence"):
            raise NotImplementedError(
                f"CrossEntropyLoss with tensor mode {mode!r}: only None, '1d' and "
                "'sequence' are supported (their logits are whole on every rank)"
            )
        kwargs["reduction"] = _reduction(reduction)
        self.loss = nn.CrossEntropyLoss(*args, **kwargs)

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of ``logits`` against ``targets``."""
        return self.loss(logits, targets)
