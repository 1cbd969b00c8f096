"""2D linear layers: :class:`Linear2D`, :class:`VocabParallelClassifier2D`, :class:`Classifier2D`.

On the q x q grid (rank ``(i, j)``, see :mod:`._grid`), for ``Y = X A`` with ``A = W^T`` and
the whole ``nn.Linear`` weight ``W`` of shape ``(out, in)``:

* ``X_ij`` is rows block ``i``, columns block ``j`` of ``X``; the weight block of rank
  ``(i, j)`` is ``A_ij``: input features block ``i``, output features block ``j``, i.e. the
  local ``W[out block j, in block i]`` of shape ``(out/q, in/q)`` (ColossalAI prints its
  ``(in, out)`` layout, ``(in/q, out/q)``: ``[128, 512]`` for the seed page's 256 -> 1024).
* Forward (SUMMA, the seed page): ``q`` steps; at step ``t`` ``X_it`` is broadcast along row
  ``i`` and ``A_tj`` along column ``j``, and ``Y_ij += X_it A_tj``. Backward: ``dX = dY A^T``
  broadcasts ``A`` along the columns and reduces the products along the rows, ``dA = X^T dY``
  broadcasts ``X`` along the rows and reduces along the columns.
* The bias ``(out/q^2,)`` is piece ``i`` of block ``j``: all-gathered over the column in the
  forward, its gradient reduce-scattered there in the backward.

Communication of one forward over ``N`` rows in all (``N/q`` per rank), element size ``e``
(the tracker's logical sizes: a broadcast's or reduce's tensor, an all-gather's output, a
reduce-scatter's input):

==================  ======  =====================  ==============================
collective, group   calls   bytes in all            when
==================  ======  =====================  ==============================
broadcast, row      q       ``N in e / q``          forward (X); backward (X again)
broadcast, column   q       ``in out e / q``        forward (A); backward (A again)
reduce, row         q       ``N in e / q``          backward (dX)
reduce, column      q       ``in out e / q``        backward (dA)
all-gather, column  1       ``out e / q``           forward (bias)
reduce-scatter, c.  1       ``out e / q``           backward (bias)
==================  ======  =====================  ==============================

Six phases of ``q`` collectives each: the seed page's latency ``O(6 (q - 1))`` (a
broadcast or reduce over ``q`` ranks takes ``q - 1`` ring steps) and, per rank, ``(q-1)/q``
of each phase's blocks: its bandwidth ``O(6 (q - 1) / q)`` in units of a block.
"""

from __future__ import annotations

import torch
from torch import nn

from colossal.core import ParallelDims
from colossal.shardformer.layer.tp2d._grid import Grid2D, check_part, check_split
from colossal.shardformer.layer.tp2d._params import (
    Level,
    agreed_seed,
    seeded,
    shard_whole,
    tied_weight,
)
from colossal.shardformer.layer.tp2d.functional import (
    classifier_2d,
    linear_2d,
    vocab_parallel_classifier_2d,
)

__all__ = ["Classifier2D", "Linear2D", "VocabParallelClassifier2D"]

#: ``W[out block j, in block i]``.
LINEAR_WEIGHT: tuple[Level, ...] = (("tp_col", 1), ("tp_row", 0))
#: ``W[class block i, in block j]`` (the vocabulary-parallel embedding's layout).
VOCAB_WEIGHT: tuple[Level, ...] = (("tp_col", 0), ("tp_row", 1))
#: Piece ``i`` of block ``j`` (biases, norms).
PIECES: tuple[Level, ...] = (("tp_row", 0), ("tp_col", 0))
#: Piece ``i`` of columns block ``j`` (the token embedding's and the classifier's layout).
COLUMN_PIECES: tuple[Level, ...] = (("tp_row", 1), ("tp_col", 1))
_REPLICATED: tuple[Level, ...] = (("tp_col", None), ("tp_row", None))

_FIX = "choose widths that divide, or another tensor-parallel size"


def _native_linear(module: nn.Module, name: str) -> nn.Linear:
    if not isinstance(module, nn.Linear):
        raise TypeError(
            f"{name}.from_native_module takes an nn.Linear, got {type(module).__name__}"
        )
    return module


def _empty(cls: type[nn.Module]) -> nn.Module:
    layer = cls.__new__(cls)
    nn.Module.__init__(layer)
    return layer


class Linear2D(nn.Module):
    """``nn.Linear`` on the 2D grid by SUMMA (see the module docstring for the layout).

    Args:
        in_features: Whole input width (divisible by ``q``).
        out_features: Whole output width (divisible by ``q``; by ``q*q`` with a bias).
        bias: Whether to learn an additive bias.
        dtype: Parameter dtype (default: torch's).
        dims: The job's layout, ``tp_mode="2d"``.

    A fresh layer is initialized like ``nn.Linear`` from a seed the tensor-parallel ranks
    agree on (collective); :meth:`from_native_module` shards an existing ``nn.Linear``.

    Raises:
        ValueError: ``dims`` is not 2D or the widths do not divide.
    """

    _weight_levels = LINEAR_WEIGHT
    _names = ("in_features", "out_features")
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
        grid = Grid2D(dims)
        self._check(in_features, out_features, bias, grid)
        native = seeded(
            lambda: nn.Linear(in_features, out_features, bias, dtype=dtype), agreed_seed(grid)
        )
        self._build(native.weight, native.bias, grid)

    @classmethod
    def from_native_module(cls, module: nn.Linear, dims: ParallelDims) -> Linear2D:
        """This rank's blocks of ``module``'s weight and bias.

        Raises:
            TypeError: ``module`` is not an ``nn.Linear``.
            ValueError: ``dims`` is not 2D or the widths do not divide.
        """
        native = _native_linear(module, cls.__name__)
        grid = Grid2D(dims)
        cls._check(native.in_features, native.out_features, native.bias is not None, grid)
        layer = _empty(cls)
        assert isinstance(layer, Linear2D)
        layer._build(native.weight, native.bias, grid)
        return layer

    @classmethod
    def _check(cls, in_features: int, out_features: int, bias: bool, grid: Grid2D) -> None:
        q = grid.q
        check_split(cls.__name__, cls._names[0], in_features, q, grid, _FIX)
        check_split(cls.__name__, cls._names[1], out_features, q * q if bias else q, grid, _FIX)

    def _build(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        grid: Grid2D,
        tied: nn.Parameter | None = None,
    ) -> None:
        self.grid = grid
        self.out_features, self.in_features = (int(s) for s in weight.shape)
        if tied is None:
            self.weight = shard_whole(weight, grid, self._weight_levels)
        else:
            self.weight = tied_weight(
                type(self).__name__, tied, weight.shape, grid, self._weight_levels
            )
        if bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = shard_whole(bias, grid, PIECES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``X_ij`` ``(n/q, ..., in/q)`` -> ``Y_ij`` ``(n/q, ..., out/q)``."""
        check_part(type(self).__name__, x, self.in_features, self.grid)
        return linear_2d(x, self.weight, self.bias, self.grid)

    def extra_repr(self) -> str:
        """Sizes, grid side and local weight, for ``repr``."""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"q={self.grid.q}, local_weight={tuple(self.weight.shape)}, "
            f"bias={self.bias is not None}"
        )


class VocabParallelClassifier2D(Linear2D):
    """The output projection onto a vocabulary split over the grid.

    The weight ``(C/q, in/q)`` is ``W[class block i, in block j]``, the layout of a
    :class:`~.embedding.VocabParallelEmbedding2D` (``weight`` ties them). Forward: SUMMA with
    the weight in place (``q`` broadcasts of it along the column, ``q`` reduces of the logits
    along the row); backward: ``q`` broadcasts of ``dY`` along the row and of the weight
    along the column, ``q`` reduces of ``dW`` along the column. The logits ``(n/q, ..., C/q)``
    hold rows block ``i`` and classes block ``j``, ready for
    :func:`~.loss.vocab_parallel_cross_entropy_2d`. The bias is stored like
    :class:`Linear2D`'s.

    Args:
        in_features: Whole input width (divisible by ``q``).
        num_classes: Classes (divisible by ``q``; by ``q*q`` with a bias).
        weight: A tied weight (the embedding's parameter), or None for a fresh one.
        bias: Whether to learn an additive bias.
        dtype: Parameter dtype.
        dims: The job's layout, ``tp_mode="2d"``.
    """

    _weight_levels = VOCAB_WEIGHT
    _names = ("in_features", "num_classes")

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
        grid = Grid2D(dims)
        self._check(in_features, num_classes, bias, grid)
        native = seeded(
            lambda: nn.Linear(in_features, num_classes, bias, dtype=dtype), agreed_seed(grid)
        )
        self._build(native.weight, native.bias, grid, weight)

    @classmethod
    def from_native_module(
        cls, module: nn.Linear, dims: ParallelDims, *, weight: nn.Parameter | None = None
    ) -> VocabParallelClassifier2D:
        """Shard ``module``; ``weight``: the tied embedding's parameter (its values win)."""
        native = _native_linear(module, cls.__name__)
        grid = Grid2D(dims)
        cls._check(native.in_features, native.out_features, native.bias is not None, grid)
        layer = _empty(cls)
        assert isinstance(layer, VocabParallelClassifier2D)
        layer._build(native.weight, native.bias, grid, weight)
        return layer

    @property
    def num_classes(self) -> int:
        """Whole number of classes."""
        return self.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``X_ij`` ``(n/q, ..., in/q)`` -> logits ``(n/q, ..., C/q)`` of classes block ``j``."""
        check_part(type(self).__name__, x, self.in_features, self.grid)
        return vocab_parallel_classifier_2d(x, self.weight, self.bias, self.grid)


class Classifier2D(nn.Module):
    """A classification head whose logits every rank of a row holds whole.

    The weight ``(C, in/q^2)`` is piece ``i`` of columns block ``j`` of the whole ``(C, in)``
    weight (an :class:`~.embedding.Embedding2D`'s layout; ``weight`` ties them); the bias
    ``(C,)`` is held by every rank. Forward: all-gather of the weight over the column, a
    local product, one all-reduce of the logits over the row. Backward: a reduce-scatter of
    the weight's gradient and an all-reduce of the bias's over the column.

    Args:
        in_features: Whole input width (divisible by ``q*q``).
        num_classes: Classes.
        weight: A tied weight (an embedding's parameter), or None for a fresh one.
        bias: Whether to learn an additive bias.
        dtype: Parameter dtype.
        dims: The job's layout, ``tp_mode="2d"``.
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
        grid = Grid2D(dims)
        self._check(in_features, grid)
        native = seeded(
            lambda: nn.Linear(in_features, num_classes, bias, dtype=dtype), agreed_seed(grid)
        )
        self._build(native, grid, weight)

    @classmethod
    def from_native_module(
        cls, module: nn.Linear, dims: ParallelDims, *, weight: nn.Parameter | None = None
    ) -> Classifier2D:
        """Shard ``module``; ``weight``: the tied embedding's parameter (its values win)."""
        native = _native_linear(module, cls.__name__)
        grid = Grid2D(dims)
        cls._check(native.in_features, grid)
        layer = _empty(cls)
        assert isinstance(layer, Classifier2D)
        layer._build(native, grid, weight)
        return layer

    @classmethod
    def _check(cls, in_features: int, grid: Grid2D) -> None:
        check_split(cls.__name__, "in_features", in_features, grid.q**2, grid, _FIX)

    def _build(self, native: nn.Linear, grid: Grid2D, weight: nn.Parameter | None) -> None:
        self.grid = grid
        self.in_features, self.num_classes = native.in_features, native.out_features
        if weight is None:
            self.weight = shard_whole(native.weight, grid, COLUMN_PIECES)
        else:
            self.weight = tied_weight(
                type(self).__name__, weight, native.weight.shape, grid, COLUMN_PIECES
            )
        if native.bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = shard_whole(native.bias, grid, _REPLICATED)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``X_ij`` ``(n/q, ..., in/q)`` -> logits ``(n/q, ..., C)`` of rows block ``i``."""
        check_part(type(self).__name__, x, self.in_features, self.grid)
        return classifier_2d(x, self.weight, self.bias, self.grid)

    def extra_repr(self) -> str:
        """Sizes and grid side, for ``repr``."""
        return (
            f"in_features={self.in_features}, num_classes={self.num_classes}, "
            f"q={self.grid.q}, bias={self.bias is not None}"
        )
