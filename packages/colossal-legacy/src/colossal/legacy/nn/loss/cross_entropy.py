"""``CrossEntropyLoss`` of ColossalAI's ``colossalai.nn``: the tensor mode's cross entropy."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from colossal.legacy.core import gpc
from colossal.shardformer.layer import CrossEntropyLoss2D, CrossEntropyLoss2p5D, CrossEntropyLoss3D

__all__ = ["CrossEntropyLoss", "torch_reduction"]

_REDUCTIONS = ("mean", "sum", "none")


def torch_reduction(reduction: bool | str) -> str:
    """ColossalAI's bool reduction (True: ``'mean'``, False: ``'none'``) as torch's name.

    Raises:
        ValueError: Neither a bool nor one of torch's names.
    """
    if isinstance(reduction, bool):
        return "mean" if reduction else "none"
    if reduction not in _REDUCTIONS:
        raise ValueError(
            f"CrossEntropyLoss: reduction={reduction!r} must be True (mean), False (none) "
            f"or one of {_REDUCTIONS}"
        )
    return reduction


def _grid_loss_kwargs(
    name: str, args: tuple[Any, ...], kwargs: dict[str, Any], allowed: tuple[str, ...]
) -> dict[str, Any]:
    """The 2D/2.5D/3D loss's keyword arguments, plus ``dims`` (and ``swapped`` in 3D).

    Raises:
        NotImplementedError: Positional torch arguments (class ``weight``...) or keywords
            the mode's loss does not take.
    """
    extra = sorted(k for k in kwargs if k not in allowed)
    if args or extra:
        raise NotImplementedError(
            f"{name} in tensor mode {gpc.tensor_parallel_mode!r} takes only "
            f"{list(allowed)} besides reduction; got {len(args)} positional and {extra}"
        )
    out = dict(kwargs, dims=gpc.dims)
    if gpc.tensor_parallel_mode == "3d":
        out["swapped"] = gpc.layer_env.swapped_3d
    return out


class CrossEntropyLoss(nn.Module):
    """Cross entropy for the config's tensor-parallel mode.

    * None, ``'1d'``, ``'sequence'`` (logits whole on every rank):
      :class:`torch.nn.CrossEntropyLoss`.
    * ``'2d'`` / ``'2.5d'`` / ``'3d'``: ``CrossEntropyLoss2D`` / ``2p5D`` / ``3D`` on the
      logits of a ``colossalai.nn.Classifier`` (this rank's rows, every class); the targets
      are the whole batch (each rank keeps its rows) and the loss is the whole batch's, the
      same on every rank. In ``'3d'`` the logits' orientation is the one the model's last
      layer left (``gpc.layer_env``): build the loss after the model.

    As in ColossalAI, ``reduction`` is a bool (True: ``'mean'``, False: ``'none'``); torch's
    names work too.

    Args:
        reduction: True/False or ``'mean'``/``'sum'``/``'none'``.
        *args: Further :class:`torch.nn.CrossEntropyLoss` arguments (``weight``...; not in
            2D/2.5D/3D).
        **kwargs: Further arguments: ``ignore_index``, ``label_smoothing`` (every mode),
            the rest of torch's (None, ``'1d'``, ``'sequence'``).

    Raises:
        ValueError: An unknown reduction.
        NotImplementedError: Arguments the 2D/2.5D/3D loss does not take, or a custom mode.
    """

    def __init__(self, reduction: bool | str = True, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        mode = gpc.tensor_parallel_mode
        kwargs["reduction"] = torch_reduction(reduction)
        if mode in (None, "1d", "sequence"):
            self.loss: nn.Module = nn.CrossEntropyLoss(*args, **kwargs)
            return
        grid = {"2d": CrossEntropyLoss2D, "2.5d": CrossEntropyLoss2p5D, "3d": CrossEntropyLoss3D}
        if mode not in grid:
            raise NotImplementedError(
                f"CrossEntropyLoss has no loss for tensor mode {mode!r}; the modes are None, "
                "'1d', '2d', '2.5d', '3d' and 'sequence'"
            )
        allowed = ("reduction", "ignore_index", "label_smoothing")
        self.loss = grid[mode](**_grid_loss_kwargs("CrossEntropyLoss", args, kwargs, allowed))

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of ``logits`` against ``targets``."""
        return self.loss(logits, targets)
