"""``colossalai.nn.LayerNorm``: ``nn.LayerNorm`` (None, ``'1d'``, ``'sequence'``) or the mode's.

In ``'1d'`` the activation around a norm is whole on every rank (after a row-parallel
Linear), so the norm is torch's, replicated. In 2D/2.5D/3D it is ``LayerNorm2D`` /
``LayerNorm2p5D`` / ``LayerNorm3D`` on this rank's block (3D in the current orientation).
"""

from __future__ import annotations

import torch
from torch import nn

from colossal.legacy.nn.layer._dispatch import (
    ModeDispatch,
    grid_dims,
    layer_env,
    tensor_mode,
    whole_state,
)
from colossal.shardformer.layer import LayerNorm2D, LayerNorm2p5D, LayerNorm3D

__all__ = ["LayerNorm"]


class LayerNorm(metaclass=ModeDispatch):
    """``colossalai.nn.LayerNorm``: layer normalization of the config's tensor mode.

    Args:
        normalized_shape: Width of the normalized (last) dim.
        eps: Added to the variance.
        bias: Whether to learn an additive bias.
        dtype: Parameter dtype.

    Raises:
        NotImplementedError: An unknown tensor mode.
        ValueError: The width does not divide as the mode needs.
    """

    _kinds = (nn.LayerNorm, LayerNorm2D, LayerNorm2p5D, LayerNorm3D)

    def __new__(  # type: ignore[misc]
        cls,
        normalized_shape: int,
        eps: float = 1e-05,
        bias: bool = True,
        dtype: torch.dtype | None = None,
    ) -> nn.Module:
        """The module of the config's tensor mode (see the class docstring)."""
        mode = tensor_mode("LayerNorm")
        if mode in (None, "1d", "sequence"):
            return nn.LayerNorm(normalized_shape, eps=eps, bias=bias, dtype=dtype)
        dims = grid_dims()
        if mode == "2d":
            return whole_state(LayerNorm2D(normalized_shape, eps, bias, dtype, dims=dims))
        if mode == "2.5d":
            return whole_state(LayerNorm2p5D(normalized_shape, eps, bias, dtype, dims=dims))
        swapped = layer_env().swapped_3d
        return whole_state(
            LayerNorm3D(normalized_shape, eps, bias, dtype, dims=dims, swapped=swapped)
        )
