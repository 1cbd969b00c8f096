"""3D linear layers: :class:`Linear3D`, :class:`VocabParallelClassifier3D`, :class:`Classifier3D`.

On a q x q x q cube (rank ``(input, weight, output)`` coordinates in the layer's orientation,
see :mod:`._cube`), for ``Y = X A`` with the whole ``nn.Linear`` weight ``(out, in)``:

* ``X``'s rows are split ``q*q`` ways (block ``weight * q + input``) and its columns ``q``
  ways (block ``output``); the weight's input features ``q`` ways (block ``output``) and its
  output features ``q*q`` ways (block ``input * q + weight``): a local ``(out/q^2, in/q)``,
  ColossalAI's ``(in/q, out/q^2)`` in its ``(in, out)`` layout.
* Forward: all-gather ``X`` along the input axis and ``A`` along the weight axis, multiply,
  reduce-scatter ``Y`` along the output axis. Backward: all-gather ``dY`` along the output
  axis, reduce-scatter ``dX`` along the input and ``dA`` along the weight axis.
* ``Y``'s columns are then split by the *input* axis: the next linear layer works in the
  swapped orientation (:attr:`Linear3D.output_swapped`; ColossalAI swaps a global instead).
* The bias ``(out/q,)`` (block ``input``) is replicated along the weight and output axes;
  its gradient is all-reduced over them.

Communication per forward over ``N`` rows in all (``N/q^2`` per rank), element size ``e``
(the tracker's logical sizes: a gather's output, a reduce-scatter's input): input all-gather
``N in e / q^2``, weight all-gather ``out in e / q^2``, output reduce-scatter
``N out e / q^2``; the backward moves the same three (gradient all-gather, input-gradient and
weight-gradient reduce-scatters) plus the bias all-reduce ``out e / q``. Each rank sends
``(q - 1) / q`` of every collective: the seed page's ``O(6 (q - 1) / q^3)`` bandwidth.
"""

from __future__ import annotations

import torch
from torch import nn

from colossal.core import ParallelDims
from colossal.shardformer.layer.tp3d._cube import Cube3D, check_part, check_split
from colossal.shardformer.layer.tp3d._params import (
    Level,
    agreed_seed,
    seeded,
    shard_whole,
    tied_weight,
)
from colossal.shardformer.layer.tp3d.functional import classifier_3d, linear_3d

__all__ = ["Classifier3D", "Linear3D", "VocabParallelClassifier3D"]

_LINEAR_WEIGHT: tuple[Level, ...] = (("output", 1), ("input", 0), ("weight", 0))
_LINEAR_BIAS: tuple[Level, ...] = (("input", 0), ("weight", None), ("output", None))
_CLASSIFIER_WEIGHT: tuple[Level, ...] = (("output", 1), ("input", None), ("weight", None))
_CLASSIFIER_BIAS: tuple[Level, ...] = (("input", None), ("weight", None), ("output", None))


def _native_linear(module: nn.Module, name: str) -> nn.Linear:
    if not isinstance(module, nn.Linear):
        raise TypeError(
            f"{name}.from_native_module takes an nn.Linear, got {type(module).__name__}"
        )
    return module


class Linear3D(nn.Module):
    """``nn.Linear`` on a 3D cube (see the module docstring for the partitioning).

    Args:
        in_features: Whole input width (divisible by ``q``).
        out_features: Whole output width (divisible by ``q*q``).
        bias: Whether to learn an additive bias.
        dtype: Parameter dtype (default: torch's).
        dims: The job's layout, ``tp_mode="3d"``.
        swapped: Orientation of the input (False: columns split along ``tp_output``); the
            output comes in the other one (:attr:`output_swapped`).

    A fresh layer is initialized like ``nn.Linear`` from a seed the tensor-parallel ranks
    agree on (collective); :meth:`from_native_module` shards an existing ``nn.Linear``.

    Raises:
        ValueError: ``dims`` is not 3D or the widths do not divide.
    """

    _what = ("in_features", "out_features")
    weight: nn.Parameter
    bias: nn.Parameter | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        *,
        dims: ParallelDims,
        swapped: bool = False,
    ) -> None:
        super().__init__()
        cube = Cube3D(dims, swapped)
        self._check(in_features, out_features, cube)
        native = seeded(
            lambda: nn.Linear(in_features, out_features, bias, dtype=dtype), agreed_seed(cube)
        )
        self._build(native.weight, native.bias, cube)

    @classmethod
    def from_native_module(
        cls, module: nn.Linear, dims: ParallelDims, *, swapped: bool = False
    ) -> Linear3D:
        """This rank's part of ``module``'s weight and bias, in orientation ``swapped``.

        Raises:
            TypeError: ``module`` is not an ``nn.Linear``.
            ValueError: ``dims`` is not 3D or the widths do not divide.
        """
        native = _native_linear(module, cls.__name__)
        cube = Cube3D(dims, swapped)
        cls._check(native.in_features, native.out_features, cube)
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._build(native.weight, native.bias, cube)
        return layer

    @classmethod
    def _check(cls, in_features: int, out_features: int, cube: Cube3D) -> None:
        q = cube.depth
        fix = "choose widths that divide, or another tensor-parallel size"
        check_split(cls.__name__, cls._what[0], in_features, q, cube, fix)
        check_split(cls.__name__, cls._what[1], out_features, q * q, cube, fix)

    def _build(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        cube: Cube3D,
        tied: nn.Parameter | None = None,
    ) -> None:
        self.cube = cube
        self.out_features, self.in_features = (int(s) for s in weight.shape)
        if tied is None:
            self.weight = shard_whole(weight, cube, _LINEAR_WEIGHT)
        else:
            self.weight = tied_weight(type(self).__name__, tied, weight.shape, cube, _LINEAR_WEIGHT)
        if bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = shard_whole(bias, cube, _LINEAR_BIAS)

    @property
    def swapped(self) -> bool:
        """The orientation of the input."""
        return self.cube.swapped

    @property
    def output_swapped(self) -> bool:
        """The orientation of the output (the next linear layer's ``swapped``)."""
        return not self.cube.swapped

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(n, ..., in/q)`` -> ``(n, ..., out/q)`` (columns now split by the input axis)."""
        check_part(type(self).__name__, x, self.in_features, self.cube)
        return linear_3d(x, self.weight, self.bias, self.cube)

    def extra_repr(self) -> str:
        """Sizes, cube side, orientation and local weight, for ``repr``."""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"q={self.cube.depth}, swapped={self.swapped}, "
            f"local_weight={tuple(self.weight.shape)}, bias={self.bias is not None}"
        )


class VocabParallelClassifier3D(Linear3D):
    """The output projection onto a vocabulary split over the cube: a :class:`Linear3D`.

    Its logits ``(n, ..., C/q)`` hold this rank's classes (block ``input``) in the flipped
    orientation, ready for :func:`~.loss.vocab_parallel_cross_entropy_3d` with
    ``swapped=output_swapped``. ``weight`` ties it to a
    :class:`~.embedding.VocabParallelEmbedding3D` of the same orientation.

    Args:
        in_features: Whole input width (divisible by ``q``).
        num_classes: Classes (divisible by ``q*q``).
        weight: A tied weight (the embedding's parameter), or None for a fresh one.
        bias: Whether to learn an additive bias.
        dtype: Parameter dtype.
        dims: The job's layout, ``tp_mode="3d"``.
        swapped: Orientation of the input.
    """

    _what = ("in_features", "num_classes")

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        weight: nn.Parameter | None = None,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        *,
        dims: ParallelDims,
        swapped: bool = False,
    ) -> None:
        nn.Module.__init__(self)
        cube = Cube3D(dims, swapped)
        self._check(in_features, num_classes, cube)
        native = seeded(
            lambda: nn.Linear(in_features, num_classes, bias, dtype=dtype), agreed_seed(cube)
        )
        self._build(native.weight, native.bias, cube, weight)

    @classmethod
    def from_native_module(
        cls,
        module: nn.Linear,
        dims: ParallelDims,
        *,
        swapped: bool = False,
        weight: nn.Parameter | None = None,
    ) -> VocabParallelClassifier3D:
        """Shard ``module``; ``weight``: the tied embedding's parameter (its values win)."""
        native = _native_linear(module, cls.__name__)
        cube = Cube3D(dims, swapped)
        cls._check(native.in_features, native.out_features, cube)
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._build(native.weight, native.bias, cube, weight)
        return layer

    @property
    def num_classes(self) -> int:
        """Whole number of classes."""
        return self.out_features


class Classifier3D(nn.Module):
    """A classification head whose logits every rank of the output axis holds whole.

    The weight ``(C, in/q)`` holds block ``output`` of the input features and is replicated
    along the input and weight axes (ColossalAI's layout; the same as an
    :class:`~.embedding.Embedding3D`'s weight, so ``weight`` ties them); the bias ``(C,)``
    is replicated everywhere. Forward: a local product, one all-reduce over the output axis.
    Backward: one all-reduce over the input and weight axes for both gradients.

    Args:
        in_features: Whole input width (divisible by ``q``).
        num_classes: Classes.
        weight: A tied weight (an embedding's parameter), or None for a fresh one.
        bias: Whether to learn an additive bias.
        dtype: Parameter dtype.
        dims: The job's layout, ``tp_mode="3d"``.
        swapped: Orientation of the input (the logits' rows stay in it).
    """

    weight: nn.Parameter
    bias: nn.Parameter | None

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        weight: nn.Parameter | None = None,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        *,
        dims: ParallelDims,
        swapped: bool = False,
    ) -> None:
        super().__init__()
        cube = Cube3D(dims, swapped)
        self._check(in_features, cube)
        native = seeded(
            lambda: nn.Linear(in_features, num_classes, bias, dtype=dtype), agreed_seed(cube)
        )
        self._build(native, cube, weight)

    @classmethod
    def from_native_module(
        cls,
        module: nn.Linear,
        dims: ParallelDims,
        *,
        swapped: bool = False,
        weight: nn.Parameter | None = None,
    ) -> Classifier3D:
        """Shard ``module``; ``weight``: the tied embedding's parameter (its values win)."""
        native = _native_linear(module, cls.__name__)
        cube = Cube3D(dims, swapped)
        cls._check(native.in_features, cube)
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._build(native, cube, weight)
        return layer

    @classmethod
    def _check(cls, in_features: int, cube: Cube3D) -> None:
        check_split(
            cls.__name__,
            "in_features",
            in_features,
            cube.depth,
            cube,
            "choose a width that divides, or another tensor-parallel size",
        )

    def _build(self, native: nn.Linear, cube: Cube3D, weight: nn.Parameter | None) -> None:
        self.cube = cube
        self.in_features, self.num_classes = native.in_features, native.out_features
        if weight is None:
            self.weight = shard_whole(native.weight, cube, _CLASSIFIER_WEIGHT)
        else:
            self.weight = tied_weight(
                type(self).__name__, weight, native.weight.shape, cube, _CLASSIFIER_WEIGHT
            )
        if native.bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = shard_whole(native.bias, cube, _CLASSIFIER_BIAS)

    @property
    def swapped(self) -> bool:
        """The orientation of the input."""
        return self.cube.swapped

    @property
    def output_swapped(self) -> bool:
        """The orientation of the logits' rows (unchanged)."""
        return self.cube.swapped

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(n, ..., in/q)`` -> ``(n, ..., C)`` logits of this rank's rows."""
        check_part(type(self).__name__, x, self.in_features, self.cube)
        return classifier_3d(x, self.weight, self.bias, self.cube)

    def extra_repr(self) -> str:
        """Sizes, cube side and orientation, for ``repr``."""
        return (
            f"in_features={self.in_features}, num_classes={self.num_classes}, "
            f"q={self.cube.depth}, swapped={self.swapped}, bias={self.bias is not None}"
        )
