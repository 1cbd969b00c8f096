"""2D embeddings: token (whole or vocabulary-parallel) and ViT patch embeddings.

They read the whole batch (token ids or images, the same on every rank) and return this
rank's block of the embedded activation: rows block ``i``, embedding columns block ``j``.

* :class:`Embedding2D`: weight ``(V, D/q^2)``, piece ``i`` of columns block ``j``
  (ColossalAI's layout, and :class:`~.linear.Classifier2D`'s, so they tie); forward
  all-gathers it over the column, backward reduce-scatters its gradient there.
* :class:`VocabParallelEmbedding2D`: weight ``(V/q, D/q)``, vocabulary block ``i`` and
  columns block ``j`` (:class:`~.linear.VocabParallelClassifier2D`'s layout); each rank looks
  up its vocabulary block for every row and a reduce-scatter over the column sums the blocks
  and keeps rows block ``i``; backward all-gathers the gradient's rows over the column.
* :class:`PatchEmbedding2D`: ViT's patchify convolution, class token and position
  embedding (ColossalAI's ``PatchEmbedding2D`` parameters), each piece ``i`` of block ``j``
  of the embedding dim, all four gathered over the column in one all-gather.
"""

from __future__ import annotations

import torch
from torch import nn

from colossal.core import ParallelDims
from colossal.shardformer.layer.tp2d._grid import Grid2D, check_split
from colossal.shardformer.layer.tp2d._params import Level, agreed_seed, seeded, shard_whole
from colossal.shardformer.layer.tp2d.functional import (
    embedding_2d,
    patch_embedding_2d,
    vocab_parallel_embedding_2d,
)
from colossal.shardformer.layer.tp2d.linear import COLUMN_PIECES, VOCAB_WEIGHT

__all__ = ["Embedding2D", "PatchEmbedding2D", "VocabParallelEmbedding2D"]

_FIX = "choose sizes that divide (pad the vocabulary), or another tensor-parallel size"


def _native_embedding(module: nn.Module, name: str) -> nn.Embedding:
    if not isinstance(module, nn.Embedding):
        raise TypeError(
            f"{name}.from_native_module takes an nn.Embedding, got {type(module).__name__}"
        )
    if module.max_norm is not None or module.sparse or module.scale_grad_by_freq:
        raise ValueError(
            f"{name}: max_norm, sparse and scale_grad_by_freq are not supported in 2D tensor "
            "parallelism; build the nn.Embedding without them"
        )
    return module


class _Embedding(nn.Module):
    """Construction shared by the two token embeddings (the subclass gives the layout)."""

    weight: nn.Parameter
    _levels: tuple[Level, ...] = COLUMN_PIECES

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        dtype: torch.dtype | None = None,
        *,
        dims: ParallelDims,
    ) -> None:
        super().__init__()
        grid = Grid2D(dims)
        self._check(num_embeddings, embedding_dim, grid)
        native = seeded(
            lambda: nn.Embedding(num_embeddings, embedding_dim, padding_idx, dtype=dtype),
            agreed_seed(grid),
        )
        self._build(native, grid)

    @classmethod
    def from_native_module(cls, module: nn.Embedding, dims: ParallelDims) -> _Embedding:
        """This rank's part of ``module``'s weight.

        Raises:
            TypeError: ``module`` is not an ``nn.Embedding``.
            ValueError: ``dims`` is not 2D, the sizes do not divide, or ``module`` uses
                ``max_norm``, ``sparse`` or ``scale_grad_by_freq``.
        """
        native = _native_embedding(module, cls.__name__)
        grid = Grid2D(dims)
        cls._check(native.num_embeddings, native.embedding_dim, grid)
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._build(native, grid)
        return layer

    @classmethod
    def _check(cls, num_embeddings: int, embedding_dim: int, grid: Grid2D) -> None:
        check_split(cls.__name__, "embedding_dim", embedding_dim, grid.q**2, grid, _FIX)

    def _build(self, native: nn.Embedding, grid: Grid2D) -> None:
        self.grid = grid
        self.num_embeddings, self.embedding_dim = native.num_embeddings, native.embedding_dim
        self.padding_idx = native.padding_idx
        self.weight = shard_whole(native.weight, grid, self._levels)

    def extra_repr(self) -> str:
        """Sizes, grid side and local weight, for ``repr``."""
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, padding_idx={self.padding_idx}, "
            f"q={self.grid.q}, local_weight={tuple(self.weight.shape)}"
        )


class Embedding2D(_Embedding):
    """``nn.Embedding`` whose weight columns are split ``q*q`` ways.

    Args:
        num_embeddings: Vocabulary size.
        embedding_dim: Whole embedding width (divisible by ``q*q``).
        padding_idx: An id whose row gets no gradient (and starts at zero).
        dtype: Parameter dtype.
        dims: The job's layout, ``tp_mode="2d"``.
    """

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The whole batch of ids ``(n, ...)`` -> ``(n/q, ..., D/q)``."""
        return embedding_2d(ids, self.weight, self.grid, self.padding_idx)


class VocabParallelEmbedding2D(_Embedding):
    """``nn.Embedding`` with the vocabulary split ``q`` ways and the width ``q`` ways.

    Args:
        num_embeddings: Vocabulary size (divisible by ``q``).
        embedding_dim: Whole embedding width (divisible by ``q``).
        padding_idx: An id whose row gets no gradient (and starts at zero).
        dtype: Parameter dtype.
        dims: The job's layout, ``tp_mode="2d"``.
    """

    _levels = VOCAB_WEIGHT

    @classmethod
    def _check(cls, num_embeddings: int, embedding_dim: int, grid: Grid2D) -> None:
        check_split(cls.__name__, "embedding_dim", embedding_dim, grid.q, grid, _FIX)
        check_split(cls.__name__, "num_embeddings", num_embeddings, grid.q, grid, _FIX)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The whole batch of ids ``(n, ...)`` -> ``(n/q, ..., D/q)``."""
        return vocab_parallel_embedding_2d(ids, self.weight, self.grid, self.padding_idx)


class _PatchParams(nn.Module):
    """The patch embedding's parameters, initialized for a fresh layer."""

    def __init__(
        self,
        patches: int,
        patch: tuple[int, int],
        in_chans: int,
        embed: int,
        dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        conv = nn.Conv2d(in_chans, embed, patch, stride=patch, dtype=dtype)
        self.weight, self.bias = conv.weight, conv.bias
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed, dtype=dtype))
        self.pos_embed = nn.Parameter(
            nn.init.trunc_normal_(torch.empty(1, patches + 1, embed, dtype=dtype), std=0.02)
        )


def _pair(value: int | tuple[int, int]) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


_EMBED_DIM: tuple[Level, ...] = (("tp_row", 0), ("tp_col", 0))
_TOKEN_DIM: tuple[Level, ...] = (("tp_row", 2), ("tp_col", 2))


class PatchEmbedding2D(nn.Module):
    """ViT's patch embedding on the 2D grid: patchify, class token, position embedding.

    Parameters (ColossalAI's names): ``weight (D/q^2, C, p, p)``, ``bias (D/q^2,)``,
    ``cls_token (1, 1, D/q^2)``, ``pos_embed (1, patches + 1, D/q^2)``.

    Args:
        img_size: Image height and width (an int for a square).
        patch_size: Patch height and width (divides ``img_size``).
        in_chans: Image channels.
        embed_size: Whole embedding width (divisible by ``q*q``).
        flatten: Return ``(n/q, patches + 1, D/q)`` tokens (False: the convolution's map).
        dtype: Parameter dtype.
        dims: The job's layout, ``tp_mode="2d"``.
    """

    weight: nn.Parameter
    bias: nn.Parameter | None
    cls_token: nn.Parameter
    pos_embed: nn.Parameter

    def __init__(
        self,
        img_size: int | tuple[int, int],
        patch_size: int | tuple[int, int],
        in_chans: int,
        embed_size: int,
        flatten: bool = True,
        dtype: torch.dtype | None = None,
        *,
        dims: ParallelDims,
    ) -> None:
        super().__init__()
        grid = Grid2D(dims)
        img, patch = _pair(img_size), _pair(patch_size)
        if img[0] % patch[0] or img[1] % patch[1]:
            raise ValueError(
                f"{type(self).__name__}: img_size={img} is not a multiple of patch_size={patch}"
            )
        self._check(embed_size, grid)
        patches = (img[0] // patch[0]) * (img[1] // patch[1])
        native = seeded(
            lambda: _PatchParams(patches, patch, in_chans, embed_size, dtype), agreed_seed(grid)
        )
        self._build(native, grid, flatten)

    @classmethod
    def from_native_module(cls, module: nn.Module, dims: ParallelDims) -> PatchEmbedding2D:
        """Shard a module holding ColossalAI's patch embedding parameters.

        ``module`` needs ``weight (D, C, p, p)``, ``bias (D,)`` or None, ``cls_token
        (1, 1, D)`` and ``pos_embed (1, patches + 1, D)``; ``flatten`` is read when present.

        Raises:
            TypeError: A parameter is missing or of the wrong rank.
            ValueError: The embedding width does not divide by ``q*q``.
        """
        ranks = {"weight": 4, "cls_token": 3, "pos_embed": 3}
        bad = [
            name
            for name, rank in ranks.items()
            if not isinstance(getattr(module, name, None), torch.Tensor)
            or getattr(module, name).dim() != rank
        ]
        if bad:
            raise TypeError(
                f"{cls.__name__}.from_native_module needs a module with weight (D, C, p, p), "
                f"bias, cls_token (1, 1, D) and pos_embed (1, patches + 1, D); {bad} are "
                f"missing or of the wrong rank in {type(module).__name__}"
            )
        grid = Grid2D(dims)
        weight: torch.Tensor = getattr(module, "weight")  # noqa: B009 - typed as a tensor
        cls._check(int(weight.shape[0]), grid)
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._build(module, grid, bool(getattr(module, "flatten", True)))
        return layer

    @classmethod
    def _check(cls, embed_size: int, grid: Grid2D) -> None:
        check_split(
            cls.__name__,
            "embed_size",
            embed_size,
            grid.q**2,
            grid,
            "choose a width that divides, or another tensor-parallel size",
        )

    def _build(self, native: nn.Module, grid: Grid2D, flatten: bool) -> None:
        self.grid, self.flatten = grid, flatten
        weight: torch.Tensor = getattr(native, "weight")  # noqa: B009 - typed as a tensor
        self.embed_size, self.in_chans = int(weight.shape[0]), int(weight.shape[1])
        self.patch_size = (int(weight.shape[2]), int(weight.shape[3]))
        self.num_patches = int(getattr(native, "pos_embed").shape[1]) - 1  # noqa: B009
        self.weight = shard_whole(weight, grid, _EMBED_DIM)
        bias = getattr(native, "bias", None)
        if bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = shard_whole(bias, grid, _EMBED_DIM)
        for name in ("cls_token", "pos_embed"):
            setattr(self, name, shard_whole(getattr(native, name), grid, _TOKEN_DIM))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """The whole batch ``(n, C, H, W)`` -> ``(n/q, patches + 1, D/q)``."""
        return patch_embedding_2d(
            images,
            self.weight,
            self.bias,
            self.cls_token,
            self.pos_embed,
            self.grid,
            self.patch_size,
            self.flatten,
        )

    def extra_repr(self) -> str:
        """Sizes and grid side, for ``repr``."""
        return (
            f"patch_size={self.patch_size}, in_chans={self.in_chans}, "
            f"embed_size={self.embed_size}, num_patches={self.num_patches}, q={self.grid.q}"
        )
