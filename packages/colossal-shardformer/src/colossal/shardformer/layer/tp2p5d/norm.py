""":class:`LayerNorm2p5D`: layer normalization of an activation whose columns the row group splits.

The input ``(n, ..., h/q)`` holds columns block ``j`` of this rank's rows; the row mean and
variance of the whole width come from two all-reduces over the row group (row sums, then
squared deviations), the backward from one (two row sums stacked). The weight and bias
``(h/q,)`` hold the same block and are replicated over the depth and the column; their
gradients are summed over those ``d*q`` ranks in one all-reduce.
"""

from __future__ import annotations

import torch
from torch import nn

from colossal.core import ParallelDims
from colossal.shardformer.layer.tp2p5d._grid import Grid2p5D, check_part, check_split
from colossal.shardformer.layer.tp2p5d._params import Level, agreed_seed, seeded, shard_whole
from colossal.shardformer.layer.tp2p5d.functional import layer_norm_2p5d

__all__ = ["LayerNorm2p5D"]

_AFFINE: tuple[Level, ...] = (("dep", None), ("col", None), ("row", 0))


class LayerNorm2p5D(nn.Module):
    """``nn.LayerNorm`` over the last dim of a 2.5D-partitioned activation.

    Args:
        normalized_shape: The whole normalized width (divisible by ``q``).
        eps: Added to the variance (torch's default).
        bias: Whether to learn an additive bias.
        dtype: Parameter dtype.
        dims: The job's layout, ``tp_mode="2.5d"``.

    Raises:
        ValueError: ``dims`` is not 2.5D or the width does not divide by ``q``.
    """

    weight: nn.Parameter | None
    bias: nn.Parameter | None

    def __init__(
        self,
        normalized_shape: int,
        eps: float = 1e-5,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        *,
        dims: ParallelDims,
    ) -> None:
        super().__init__()
        grid = Grid2p5D(dims)
        self._check(normalized_shape, grid)
        native = seeded(
            lambda: nn.LayerNorm(normalized_shape, eps, bias=bias, dtype=dtype), agreed_seed(grid)
        )
        self._build(native, grid)

    @classmethod
    def from_native_module(cls, module: nn.LayerNorm, dims: ParallelDims) -> LayerNorm2p5D:
        """This rank's part of ``module``'s weight and bias (normalizing the last dim only).

        Raises:
            TypeError: ``module`` is not an ``nn.LayerNorm``.
            ValueError: It normalizes more than one dim, or the width does not divide.
        """
        if not isinstance(module, nn.LayerNorm):
            raise TypeError(
                f"{cls.__name__}.from_native_module takes an nn.LayerNorm, got "
                f"{type(module).__name__}"
            )
        if len(module.normalized_shape) != 1:
            raise ValueError(
                f"{cls.__name__}: normalized_shape={tuple(module.normalized_shape)} normalizes "
                "several dims; the 2.5D layer normalizes the last dim only"
            )
        grid = Grid2p5D(dims)
        cls._check(module.normalized_shape[0], grid)
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._build(module, grid)
        return layer

    @classmethod
    def _check(cls, width: int, grid: Grid2p5D) -> None:
        check_split(
            cls.__name__,
            "normalized_shape",
            width,
            grid.q,
            grid,
            "choose a width that divides, or another tensor-parallel size",
        )

    def _build(self, native: nn.LayerNorm, grid: Grid2p5D) -> None:
        self.grid = grid
        self.normalized_shape = (int(native.normalized_shape[0]),)
        self.eps = float(native.eps)
        for name in ("weight", "bias"):
            value = getattr(native, name, None)
            if value is None:
                self.register_parameter(name, None)
            else:
                setattr(self, name, shard_whole(value, grid, _AFFINE))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize ``(n, ..., h/q)`` over the whole width ``h``."""
        check_part(type(self).__name__, x, self.normalized_shape[0], self.grid)
        return layer_norm_2p5d(
            x, self.weight, self.bias, self.normalized_shape[0], self.eps, self.grid
        )

    def extra_repr(self) -> str:
        """Width, eps and grid, for ``repr``."""
        return f"{self.normalized_shape}, eps={self.eps}, d={self.grid.depth}, q={self.grid.q}"
