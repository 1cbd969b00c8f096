"""``colossalai.nn.Dropout``: dropout seeded as the mode's activation needs.

* None, ``'sequence'``: ``nn.Dropout`` (torch's generator).
* ``'1d'``: after a column-parallel Linear (``gpc.layer_env.parallel_input``) the activation
  is split, so each rank draws its own mask (``DropoutForParallelInput``); otherwise it is
  whole on every rank and the ranks draw the same mask (``DropoutForReplicatedInput``),
  keeping the copies equal (ColossalAI's ``Dropout1D`` with the tensor seed).
* ``'2d'`` / ``'2.5d'`` / ``'3d'``: ``Dropout2D`` / ``Dropout2p5D`` / ``Dropout3D`` for a
  partitioned activation (every rank holds a different block: a different mask per rank).
"""

from __future__ import annotations

from torch import nn

from colossal.legacy.nn.layer._dispatch import (
    ModeDispatch,
    grid_dims,
    layer_env,
    tensor_mode,
    tp_group_1d,
)
from colossal.shardformer.layer import (
    Dropout2D,
    Dropout2p5D,
    Dropout3D,
    DropoutForParallelInput,
    DropoutForReplicatedInput,
)

__all__ = ["Dropout"]


class Dropout(metaclass=ModeDispatch):
    """``colossalai.nn.Dropout``: dropout of the config's tensor mode (see the module doc).

    Args:
        p: Probability of an element to be zeroed.
        inplace: Zero in place.

    Raises:
        NotImplementedError: An unknown tensor mode.
    """

    _kinds = (
        nn.Dropout,
        DropoutForParallelInput,
        DropoutForReplicatedInput,
        Dropout2D,
        Dropout2p5D,
        Dropout3D,
    )

    def __new__(cls, p: float = 0.5, inplace: bool = False) -> nn.Module:  # type: ignore[misc]
        """The module of the config's tensor mode (see the class docstring)."""
        mode = tensor_mode("Dropout")
        if mode in (None, "sequence"):
            return nn.Dropout(p, inplace)
        if mode == "1d":
            kind = (
                DropoutForParallelInput if layer_env().parallel_input else DropoutForReplicatedInput
            )
            return kind(p, inplace, tp_group_1d())
        dims = grid_dims()
        if mode == "2d":
            return Dropout2D(p, inplace, dims=dims)
        if mode == "2.5d":
            return Dropout2p5D(p, inplace, dims=dims)
        return Dropout3D(p, inplace, dims=dims, swapped=layer_env().swapped_3d)
