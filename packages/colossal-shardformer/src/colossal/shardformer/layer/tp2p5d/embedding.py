"""2.5D embeddings: token (whole or vocabulary-parallel) and ViT patch embeddings.

They read the whole batch (token ids or images, the same on every rank) and return this
rank's block of the embedded activation: rows block ``k*q + i`` of ``d*q``, embedding
columns block ``j`` of ``q``.

* :class:`Embedding2p5D`: weight ``(V, D/q)`` (columns block ``j``), replicated over the
  depth and the column; no forward communication, one all-reduce of the weight gradient
  over those ``d*q`` ranks.
* :class:`VocabParallelEmbedding2p5D`: weight ``(V/q, D/q)`` (vocabulary block ``i``,
  columns block ``j``: the :class:`~.linear.VocabParallelClassifier2p5D` layout, so they
  tie), replicated over the depth; the forward looks up the layer's rows in this vocabulary
  block and reduce-scatters them over the column, the backward all-gathers the gradient over
  the column and all-reduces the weight's over the depth.
* :class:`PatchEmbedding2p5D`: ViT's patchify convolution, class token and position
  embedding, each holding block ``j`` of the embedding dim, replicated over the depth and
  the column (ColossalAI's ``VanillaPatchEmbedding`` parameters).
"""

from __future__ import annotations

import torch
from torch import nn

from colossal.core import ParallelDims
from colossal.shardformer.layer.tp2p5d._grid import Grid2p5D, check_split
from colossal.shardformer.layer.tp2p5d._params import Level, agreed_seed, seeded, shard_whole
from colossal.shardformer.layer.tp2p5d.functional import (
    embedding_2p5d,
    patch_embedding_2p5d,
    vocab_parallel_embedding_2p5d,
)
from colossal.shardformer.layer.tp2p5d.linear import COLUMNS_WEIGHT, VOCAB_WEIGHT

__all__ = ["Embedding2p5D", "PatchEmbedding2p5D", "VocabParallelEmbedding2p5D"]

_FIX = "choose sizes that divide (pad the vocabulary), or another tensor-parallel size"


def _native_embedding(module: nn.Module, name: str) -> nn.Embedding:
    if not isinstance(module, nn.Embedding):
        raise TypeError(
            f"{name}.from_native_module takes an nn.Embedding, got {type(module).__name__}"
        )
    if module.max_norm is not None or module.sparse or module.scale_grad_by_freq:
        raise ValueError(
            f"{name}: max_norm, sparse and scale_grad_by_freq are not supported in 2.5D "
            "tensor parallelism; build the nn.Embedding without them"
        )
    return module


class _Embedding(nn.Module):
    """Shared construction of the two token embeddings (the subclass gives the layout)."""

    weight: nn.Parameter
    _levels: tuple[Level, ...] = COLUMNS_WEIGHT
    _vocab_split = False

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
        grid = Grid2p5D(dims)
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
            ValueError: ``dims`` is not 2.5D, the sizes do not divide, or ``module`` uses
                ``max_norm``, ``sparse`` or ``scale_grad_by_freq``.
        """
        native = _native_embedding(module, cls.__name__)
        grid = Grid2p5D(dims)
        cls._check(native.num_embeddings, native.embedding_dim, grid)
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._build(native, grid)
        return layer

    @classmethod
    def _check(cls, num_embeddings: int, embedding_dim: int, grid: Grid2p5D) -> None:
        check_split(cls.__name__, "embedding_dim", embedding_dim, grid.q, grid, _FIX)
        if cls._vocab_split:
            check_split(cls.__name__, "num_embeddings", num_embeddings, grid.q, grid, _FIX)

    def _build(self, native: nn.Embedding, grid: Grid2p5D) -> None:
        self.grid = grid
        self.num_embeddings, self.embedding_dim = native.num_embeddings, native.embedding_dim
        self.padding_idx = native.padding_idx
        self.weight = shard_whole(native.weight, grid, self._levels)

    def extra_repr(self) -> str:
        """Sizes, grid and local weight, for ``repr``."""
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, padding_idx={self.padding_idx}, "
            f"d={self.grid.depth}, q={self.grid.q}, local_weight={tuple(self.weight.shape)}"
        )


class Embedding2p5D(_Embedding):
    """``nn.Embedding`` whose weight columns the row group splits (replicated elsewhere).

    Args:
        num_embeddings: Vocabulary size.
        embedding_dim: Whole embedding width (divisible by ``q``).
        padding_idx: An id whose row gets no gradient (and starts at zero).
        dtype: Parameter dtype.
        dims: The job's layout, ``tp_mode="2.5d"``.
    """

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The whole batch of ids ``(batch, ...)`` -> ``(batch/(d q), ..., D/q)``."""
        return embedding_2p5d(ids, self.weight, self.grid, self.padding_idx)


class VocabParallelEmbedding2p5D(_Embedding):
    """``nn.Embedding`` with the vocabulary split by the column and the width by the row.

    Args:
        num_embeddings: Vocabulary size (divisible by ``q``).
        embedding_dim: Whole embedding width (divisible by ``q``).
        padding_idx: An id whose row gets no gradient (and starts at zero).
        dtype: Parameter dtype.
        dims: The job's layout, ``tp_mode="2.5d"``.
    """

    _levels = VOCAB_WEIGHT
    _vocab_split = True

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The whole batch of ids ``(batch, ...)`` -> ``(batch/(d q), ..., D/q)``."""
        return vocab_parallel_embedding_2p5d(ids, self.weight, self.grid, self.padding_idx)


class _PatchParams(nn.Module):
    """ColossalAI's ``VanillaPatchEmbedding`` parameters, initialized for a fresh layer."""

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


def _feature_levels(dim: int) -> tuple[Level, ...]:
    return (("dep", None), ("col", None), ("row", dim))


class PatchEmbedding2p5D(nn.Module):
    """ViT's patch embedding on a 2.5D grid: patchify, class token, position embedding.

    Parameters (ColossalAI's names): ``weight (D/q, C, p, p)``, ``bias (D/q,)``,
    ``cls_token (1, 1, D/q)``, ``pos_embed (1, patches + 1, D/q)``.

    Args:
        img_size: Image height and width (an int for a square).
        patch_size: Patch height and width (divides ``img_size``).
        in_chans: Image channels.
        embed_size: Whole embedding width (divisible by ``q``).
        flatten: Return ``(n, patches + 1, D/q)`` tokens (False: the convolution's map).
        dtype: Parameter dtype.
        dims: The job's layout, ``tp_mode="2.5d"``.
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
        grid = Grid2p5D(dims)
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
    def from_native_module(cls, module: nn.Module, dims: ParallelDims) -> PatchEmbedding2p5D:
        """Shard a module holding ColossalAI's ``VanillaPatchEmbedding`` parameters.

        ``module`` needs ``weight (D, C, p, p)``, ``bias (D,)`` or None, ``cls_token
        (1, 1, D)`` and ``pos_embed (1, patches + 1, D)``; ``flatten`` is read when present.

        Raises:
            TypeError: A parameter is missing or of the wrong rank.
            ValueError: The embedding width does not divide by ``q``.
        """
        tensors = {n: getattr(module, n, None) for n in ("weight", "cls_token", "pos_embed")}
        ranks = {"weight": 4, "cls_token": 3, "pos_embed": 3}
        bad = [
            n for n, t in tensors.items() if not isinstance(t, torch.Tensor) or t.dim() != ranks[n]
        ]
        if bad:
            raise TypeError(
                f"{cls.__name__}.from_native_module needs a module with weight (D, C, p, p), "
                f"bias, cls_token (1, 1, D) and pos_embed (1, patches + 1, D); {bad} are "
                f"missing or of the wrong rank in {type(module).__name__}"
            )
        grid = Grid2p5D(dims)
        cls._check(int(getattr(module, "weight").shape[0]), grid)  # noqa: B009
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._build(module, grid, bool(getattr(module, "flatten", True)))
        return layer

    @classmethod
    def _check(cls, embed_size: int, grid: Grid2p5D) -> None:
        check_split(
            cls.__name__,
            "embed_size",
            embed_size,
            grid.q,
            grid,
            "choose a width that divides, or another tensor-parallel size",
        )

    def _build(self, native: nn.Module, grid: Grid2p5D, flatten: bool) -> None:
        self.grid, self.flatten = grid, flatten
        weight: torch.Tensor = getattr(native, "weight")  # noqa: B009 - typed as a tensor
        self.embed_size, self.in_chans = int(weight.shape[0]), int(weight.shape[1])
        self.patch_size = (int(weight.shape[2]), int(weight.shape[3]))
        self.num_patches = int(getattr(native, "pos_embed").shape[1]) - 1  # noqa: B009
        self.weight = shard_whole(weight, grid, _feature_levels(0))
        bias = getattr(native, "bias", None)
        if bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = shard_whole(bias, grid, _feature_levels(0))
        for name in ("cls_token", "pos_embed"):
            whole: torch.Tensor = getattr(native, name)
            setattr(self, name, shard_whole(whole, grid, _feature_levels(2)))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """The whole batch ``(batch, C, H, W)`` -> ``(batch/(d q), patches + 1, D/q)``."""
        return patch_embedding_2p5d(
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
        """Sizes and grid, for ``repr``."""
        return (
            f"patch_size={self.patch_size}, in_chans={self.in_chans}, "
            f"embed_size={self.embed_size}, num_patches={self.num_patches}, "
            f"d={self.grid.depth}, q={self.grid.q}"
        )
