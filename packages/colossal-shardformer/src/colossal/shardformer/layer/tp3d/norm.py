""":class:`LayerNorm3D`: layer normalization of an activation whose columns the cube splits.

The input ``(n, ..., h/q)`` holds columns block ``output`` of this rank's rows; the row mean
and variance of the whole width come from two all-reduces over the output axis (row sums,
then squared deviations), the backward from one (two row sums stacked). The weight and bias
``(h/q,)`` hold the same block and are replicated along the input and weight axes; their
gradients are summed over those axes in one all-reduce.
"""

from __future__ import annotations

import torch
from torch import nn

from colossal.core import ParallelDims
from colossal.shardformer.layer.tp3d._cube import Cube3D, check_part, check_split
from colossal.shardformer.layer.tp3d._params import Level, agreed_seed, seeded, shard_whole
from colossal.shardformer.layer.tp3d.functional import layer_norm_3d

__all__ = ["LayerNorm3D"]

_AFFINE: tuple[Level, ...] = (("output", 0), ("input", None), ("weight", None))


class LayerNorm3D(nn.Module):
    """``nn.LayerNorm`` over the last dim of a 3D-partitioned activation.

    Args:
        normalized_shape: The whole normalized width (divisible by ``q``).
        eps: Added to the variance (torch's default; ColossalAI's was ``1e-12``).
        bias: Whether to learn an additive bias.
        dtype: Parameter dtype.
        dims: The job's layout, ``tp_mode="3d"``.
        swapped: Orientation of the input (and output: normalization keeps the layout).

    Raises:
        ValueError: ``dims`` is not 3D or the width does not divide by ``q``.
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
        swapped: bool = False,
    ) -> None:
        super().__init__()
        cube = Cube3D(dims, swapped)
        self._check(normalized_shape, cube)
        native = seeded(
            lambda: nn.LayerNorm(normalized_shape, eps, bias=bias, dtype=dtype), agreed_seed(cube)
        )
        self._build(native, cube)

    @classmethod
    def from_native_module(
        cls, module: nn.LayerNorm, dims: ParallelDims, *, swapped: bool = False
    ) -> LayerNorm3D:
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
                "several dims; the 3D layer normalizes the last dim only"
            )
        cube = Cube3D(dims, swapped)
        cls._check(module.normalized_shape[0], cube)
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._build(module, cube)
        return layer

    @classmethod
    def _check(cls, width: int, cube: Cube3D) -> None:
        check_split(
            cls.__name__,
            "normalized_shape",
            width,
            cube.depth,
            cube,
            "choose a width that divides, or another tensor-parallel size",
        )

    def _build(self, native: nn.LayerNorm, cube: Cube3D) -> None:
        self.cube = cube
        self.normalized_shape = (int(native.normalized_shape[0]),)
        self.eps = float(native.eps)
        for name in ("weight", "bias"):
            value = getattr(native, name, None)
            if value is None:
                self.register_parameter(name, None)
            else:
                setattr(self, name, shard_whole(value, cube, _AFFINE))

    @property
    def swapped(self) -> bool:
        """The orientation of the input and output."""
        return self.cube.swapped

    @property
    def output_swapped(self) -> bool:
        """The orientation of the output (unchanged)."""
        return self.cube.swapped

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize ``(n, ..., h/q)`` over the whole width ``h``."""
        check_part(type(self).__name__, x, self.normalized_shape[0], self.cube)
        return layer_norm_3d(
            x, self.weight, self.bias, self.normalized_shape[0], self.eps, self.cube
        )

    def extra_repr(self) -> str:
        """Width, eps, cube side and orientation, for ``repr``."""
        return (
            f"{self.normalized_shape}, eps={self.eps}, q={self.cube.depth}, swapped={self.swapped}"
        )
