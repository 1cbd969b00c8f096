"""``colossalai.nn.Linear2D`` / ``Linear2p5D`` / ``Linear3D``: one mode's Linear by name.

The seeds' "write a simple 2D parallel model" page uses ``from colossalai.nn import
Linear2D`` with ``tensor=dict(mode='2d')``: ColossalAI's mode layers took their groups from
the global context. These are the shardformer layers built on ``gpc.dims`` (with whole
state dicts); ``Linear3D`` follows and advances ``gpc.layer_env``'s orientation like
``colossalai.nn.Linear``.
"""

from __future__ import annotations

import torch

from colossal.legacy.nn.layer._dispatch import grid_dims, layer_env, whole_state
from colossal.shardformer.layer import tp2d, tp2p5d, tp3d

__all__ = ["Linear2D", "Linear2p5D", "Linear3D"]


class Linear2D(tp2d.Linear2D):
    """:class:`colossal.shardformer.layer.Linear2D` on the launched job's grid.

    Args:
        in_features: Whole input width.
        out_features: Whole output width.
        bias: Whether to learn an additive bias.
        dtype: Parameter dtype.

    Raises:
        ValueError: The config's tensor mode is not ``'2d'`` or the widths do not divide.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, dtype, dims=grid_dims())
        whole_state(self)


class Linear2p5D(tp2p5d.Linear2p5D):
    """:class:`colossal.shardformer.layer.Linear2p5D` on the launched job's grid.

    Args:
        in_features: Whole input width.
        out_features: Whole output width.
        bias: Whether to learn an additive bias.
        dtype: Parameter dtype.

    Raises:
        ValueError: The config's tensor mode is not ``'2.5d'`` or the widths do not divide.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, dtype, dims=grid_dims())
        whole_state(self)


class Linear3D(tp3d.Linear3D):
    """:class:`colossal.shardformer.layer.Linear3D` on the job's cube, in the current orientation.

    Args:
        in_features: Whole input width.
        out_features: Whole output width.
        bias: Whether to learn an additive bias.
        dtype: Parameter dtype.

    Raises:
        ValueError: The config's tensor mode is not ``'3d'`` or the widths do not divide.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        dtype: torch.dtype | None = None,
    ) -> None:
        env = layer_env()
        super().__init__(
            in_features, out_features, bias, dtype, dims=grid_dims(), swapped=env.swapped_3d
        )
        env.swapped_3d = self.output_swapped
        whole_state(self)
