"""2.5D linear layers: :class:`Linear2p5D`, the vocabulary-parallel and the replicated heads.

On ``d`` layers of a q x q grid (rank ``(k, i, j)``, see :mod:`._grid`), for ``Y = X A`` with
the whole ``nn.Linear`` weight ``W = A^T`` ``(out, in)``:

* ``X``'s rows are split ``d*q`` ways (block ``k*q + i``) and its columns ``q`` ways (block
  ``j``); ``A`` is split q x q as in 2D (``A_ij``: input features block ``i``, output
  features block ``j``) and replicated over the depth: a local ``(out/q, in/q)`` in torch's
  layout, ColossalAI's ``(in/q, out/q)``.
* Forward (Tesseract: SUMMA in each layer ``k``): all-gather ``X`` over the row and ``A``
  over the column, multiply; ``Y`` comes in ``X``'s layout. Backward: re-gather ``A``,
  reduce-scatter ``dX`` over the row; re-gather ``X``, reduce-scatter ``dA`` over the
  column and all-reduce it over the depth.
* The bias ``(out/q,)`` (block ``j``) is replicated over the depth and the column; its
  gradient is all-reduced over those ``d*q`` ranks.

Communication per forward over ``N`` rows in all (``N/(d q)`` per rank), element size ``e``
(the tracker's logical sizes: a gather's output, a reduce-scatter's input): input all-gather
``N in e / (d q)``, weight all-gather ``out in e / q``; the backward re-gathers both and
reduce-scatters ``dX`` (``N in e / (d q)``) and ``dA`` (``out in e / q``), all-reduces
``dA`` over the depth (``out in e / q^2``) and the bias gradient (``out e / q``). A rank
sends ``(q - 1) / q`` of each gather and reduce-scatter: per matmul ``(q - 1)(N in / d +
out in) / q^2`` elements; with ``N = in = out = h`` that is ``(q - 1)(d + 1) / (d q)`` times
``h^2 / q``, three times per step: the seed page's ``O(3 (q - 1)(d + 1) / (d q))``.
"""

from __future__ import annotations

import torch
from torch import nn

from colossal.core import ParallelDims
from colossal.shardformer.layer.tp2p5d._grid import Grid2p5D, check_part, check_split
from colossal.shardformer.layer.tp2p5d._params import (
    Level,
    agreed_seed,
    seeded,
    shard_whole,
    tied_weight,
)
from colossal.shardformer.layer.tp2p5d.functional import (
    classifier_2p5d,
    linear_2p5d,
    vocab_parallel_classifier_2p5d,
)

__all__ = ["Classifier2p5D", "Linear2p5D", "VocabParallelClassifier2p5D"]

_LINEAR_WEIGHT: tuple[Level, ...] = (("dep", None), ("col", 1), ("row", 0))
#: The vocabulary-parallel embedding's layout: rows (classes) block ``i``, columns ``j``.
VOCAB_WEIGHT: tuple[Level, ...] = (("dep", None), ("col", 0), ("row", 1))
#: The replicated embedding's and classifier's layout: columns block ``j``.
COLUMNS_WEIGHT: tuple[Level, ...] = (("dep", None), ("col", None), ("row", 1))
_FEATURES: tuple[Level, ...] = (("dep", None), ("col", None), ("row", 0))
_EVERYWHERE: tuple[Level, ...] = (("dep", None), ("col", None), ("row", None))

_FIX = "choose widths that divide, or another tensor-parallel size"


def _native_linear(module: nn.Module, name: str) -> nn.Linear:
    if not isinstance(module, nn.Linear):
        raise TypeError(
            f"{name}.from_native_module takes an nn.Linear, got {type(module).__name__}"
        )
    return module


class Linear2p5D(nn.Module):
    """``nn.Linear`` on a 2.5D grid (see the module docstring for the partitioning).

    Args:
        in_features: Whole input width (divisible by ``q``).
        out_features: Whole output width (divisible by ``q``).
        bias: Whether to learn an additive bias.
        dtype: Parameter dtype (default: torch's).
        dims: The job's layout, ``tp_mode="2.5d"``.

    A fresh layer is initialized like ``nn.Linear`` from a seed the tensor-parallel ranks
    agree on (collective); :meth:`from_native_module` shards an existing ``nn.Linear``.

    Raises:
        ValueError: ``dims`` is not 2.5D or the widths do not divide.
    """

    _what = ("in_features", "out_features")
    _weight_levels = _LINEAR_WEIGHT
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
    ) -> None:
        super().__init__()
        grid = Grid2p5D(dims)
        self._check(in_features, out_features, grid)
        native = seeded(
            lambda: nn.Linear(in_features, out_features, bias, dtype=dtype), agreed_seed(grid)
        )
        self._build(native.weight, native.bias, grid)

    @classmethod
    def from_native_module(cls, module: nn.Linear, dims: ParallelDims) -> Linear2p5D:
        """This rank's part of ``module``'s weight and bias.

        Raises:
            TypeError: ``module`` is not an ``nn.Linear``.
            ValueError: ``dims`` is not 2.5D or the widths do not divide.
        """
        native = _native_linear(module, cls.__name__)
        grid = Grid2p5D(dims)
        cls._check(native.in_features, native.out_features, grid)
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._build(native.weight, native.bias, grid)
        return layer

    @classmethod
    def _check(cls, in_features: int, out_features: int, grid: Grid2p5D) -> None:
        check_split(cls.__name__, cls._what[0], in_features, grid.q, grid, _FIX)
        check_split(cls.__name__, cls._what[1], out_features, grid.q, grid, _FIX)

    def _build(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        grid: Grid2p5D,
        tied: nn.Parameter | None = None,
    ) -> None:
        self.grid = grid
        self.out_features, self.in_features = (int(s) for s in weight.shape)
        levels = self._weight_levels
        if tied is None:
            self.weight = shard_whole(weight, grid, levels)
        else:
            self.weight = tied_weight(type(self).__name__, tied, weight.shape, grid, levels)
        if bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = shard_whole(bias, grid, _FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(n, ..., in/q)`` -> ``(n, ..., out/q)``, both block ``(k*q + i, j)``."""
        check_part(type(self).__name__, x, self.in_features, self.grid)
        return linear_2p5d(x, self.weight, self.bias, self.grid)

    def extra_repr(self) -> str:
        """Sizes, grid and local weight, for ``repr``."""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"d={self.grid.depth}, q={self.grid.q}, "
            f"local_weight={tuple(self.weight.shape)}, bias={self.bias is not None}"
        )


class VocabParallelClassifier2p5D(Linear2p5D):
    """The output projection onto a vocabulary split over the grid's rows and columns.

    Its weight ``(C/q, in/q)`` holds classes block ``i`` and input features block ``j`` (the
    layout of a :class:`~.embedding.VocabParallelEmbedding2p5D`, so ``weight`` ties them),
    replicated over the depth. Forward: all-gather the weight over the column, multiply,
    reduce-scatter the logits over the row; the logits ``(n, ..., C/q)`` hold this rank's
    rows and classes block ``j``, ready for
    :func:`~.loss.vocab_parallel_cross_entropy_2p5d`. Backward: all-gather the logits'
    gradient over the row and the weight over the column, reduce-scatter the weight's
    gradient over the column and all-reduce it over the depth.

    Args:
        in_features: Whole input width (divisible by ``q``).
        num_classes: Classes (divisible by ``q``).
        weight: A tied weight (the embedding's parameter), or None for a fresh one.
        bias: Whether to learn an additive bias (block ``j``, like the logits).
        dtype: Parameter dtype.
        dims: The job's layout, ``tp_mode="2.5d"``.
    """

    _what = ("in_features", "num_classes")
    _weight_levels = VOCAB_WEIGHT

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        weight: nn.Parameter | None = None,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        *,
        dims: ParallelDims,
    ) -> None:
        nn.Module.__init__(self)
        grid = Grid2p5D(dims)
        self._check(in_features, num_classes, grid)
        native = seeded(
            lambda: nn.Linear(in_features, num_classes, bias, dtype=dtype), agreed_seed(grid)
        )
        self._build(native.weight, native.bias, grid, weight)

    @classmethod
    def from_native_module(
        cls, module: nn.Linear, dims: ParallelDims, *, weight: nn.Parameter | None = None
    ) -> VocabParallelClassifier2p5D:
        """Shard ``module``; ``weight``: the tied embedding's parameter (its values win)."""
        native = _native_linear(module, cls.__name__)
        grid = Grid2p5D(dims)
        cls._check(native.in_features, native.out_features, grid)
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._build(native.weight, native.bias, grid, weight)
        return layer

    @property
    def num_classes(self) -> int:
        """Whole number of classes."""
        return self.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(n, ..., in/q)`` -> ``(n, ..., C/q)`` logits of this rank's rows and classes."""
        check_part(type(self).__name__, x, self.in_features, self.grid)
        return vocab_parallel_classifier_2p5d(x, self.weight, self.bias, self.grid)


class Classifier2p5D(nn.Module):
    """A classification head whose logits every rank of the row group holds whole.

    The weight ``(C, in/q)`` holds block ``j`` of the input features and is replicated over
    the depth and the column (ColossalAI's layout; the same as an
    :class:`~.embedding.Embedding2p5D`'s weight, so ``weight`` ties them); the bias ``(C,)``
    is replicated everywhere. Forward: a local product, one all-reduce over the row.
    Backward: one all-reduce over the depth and column for both gradients.

    Args:
        in_features: Whole input width (divisible by ``q``).
        num_classes: Classes.
        weight: A tied weight (an embedding's parameter), or None for a fresh one.
        bias: Whether to learn an additive bias.
        dtype: Parameter dtype.
        dims: The job's layout, ``tp_mode="2.5d"``.
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
    ) -> None:
        super().__init__()
        grid = Grid2p5D(dims)
        self._check(in_features, grid)
        native = seeded(
            lambda: nn.Linear(in_features, num_classes, bias, dtype=dtype), agreed_seed(grid)
        )
        self._build(native, grid, weight)

    @classmethod
    def from_native_module(
        cls, module: nn.Linear, dims: ParallelDims, *, weight: nn.Parameter | None = None
    ) -> Classifier2p5D:
        """Shard ``module``; ``weight``: the tied embedding's parameter (its values win)."""
        native = _native_linear(module, cls.__name__)
        grid = Grid2p5D(dims)
        cls._check(native.in_features, grid)
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._build(native, grid, weight)
        return layer

    @classmethod
    def _check(cls, in_features: int, grid: Grid2p5D) -> None:
        check_split(cls.__name__, "in_features", in_features, grid.q, grid, _FIX)

    def _build(self, native: nn.Linear, grid: Grid2p5D, weight: nn.Parameter | None) -> None:
        self.grid = grid
        self.in_features, self.num_classes = native.in_features, native.out_features
        if weight is None:
            self.weight = shard_whole(native.weight, grid, COLUMNS_WEIGHT)
        else:
            self.weight = tied_weight(
                type(self).__name__, weight, native.weight.shape, grid, COLUMNS_WEIGHT
            )
        if native.bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = shard_whole(native.bias, grid, _EVERYWHERE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(n, ..., in/q)`` -> ``(n, ..., C)`` logits of this rank's rows."""
        check_part(type(self).__name__, x, self.in_features, self.grid)
        return classifier_2p5d(x, self.weight, self.bias, self.grid)

    def extra_repr(self) -> str:
        """Sizes and grid, for ``repr``."""
        return (
            f"in_features={self.in_features}, num_classes={self.num_classes}, "
            f"d={self.grid.depth}, q={self.grid.q}, bias={self.bias is not None}"
        )
