"""3D embeddings: token (whole or vocabulary-parallel) and ViT patch embeddings.

They read the whole batch (token ids or images, the same on every rank) and return this
rank's part of the embedded activation in the layer's orientation: rows block
``weight * q + input`` of ``q*q``, embedding columns block ``output`` of ``q``.

* :class:`Embedding3D`: weight ``(V, D/q)`` (columns block ``output``), replicated along the
  input and weight axes; no forward communication, one all-reduce of the weight gradient
  over input x weight.
* :class:`VocabParallelEmbedding3D`: weight ``(V/q^2, D/q)`` (vocabulary block
  ``input * q + weight``, the :class:`~.linear.Linear3D` layout, so it ties with a
  :class:`~.linear.VocabParallelClassifier3D`); forward all-gathers the weight along the
  weight axis and reduce-scatters the looked-up rows along the input axis, backward
  all-gathers the gradient along the input axis and reduce-scatters the weight's along the
  weight axis.
* :class:`PatchEmbedding3D`: ViT's patchify convolution, class token and position
  embedding, each holding block ``output`` of the embedding dim, replicated along input and
  weight (ColossalAI's ``VanillaPatchEmbedding`` parameters).
"""

from __future__ import annotations

import torch
from torch import nn

from colossal.core import ParallelDims
from colossal.shardformer.layer.tp3d._cube import Cube3D, check_split
from colossal.shardformer.layer.tp3d._params import Level, agreed_seed, seeded, shard_whole
from colossal.shardformer.layer.tp3d.functional import (
    embedding_3d,
    patch_embedding_3d,
    vocab_parallel_embedding_3d,
)

__all__ = ["Embedding3D", "PatchEmbedding3D", "VocabParallelEmbedding3D"]

_COLUMNS: tuple[Level, ...] = (("output", 1), ("input", None), ("weight", None))
_VOCAB: tuple[Level, ...] = (("output", 1), ("input", 0), ("weight", 0))


def _native_embedding(module: nn.Module, name: str) -> nn.Embedding:
    if not isinstance(module, nn.Embedding):
        raise TypeError(
            f"{name}.from_native_module takes an nn.Embedding, got {type(module).__name__}"
        )
    if module.max_norm is not None or module.sparse or module.scale_grad_by_freq:
        raise ValueError(
            f"{name}: max_norm, sparse and scale_grad_by_freq are not supported in 3D tensor "
            "parallelism; build the nn.Embedding without them"
        )
    return module


class _Embedding(nn.Module):
    """Shared construction of the two token embeddings (the subclass gives the layout)."""

    weight: nn.Parameter
    _levels: tuple[Level, ...] = _COLUMNS
    _vocab_parts = 1  # the vocabulary is split into this many blocks per q (1 or q)

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        dtype: torch.dtype | None = None,
        *,
        dims: ParallelDims,
        swapped: bool = False,
    ) -> None:
        super().__init__()
        cube = Cube3D(dims, swapped)
        self._check(num_embeddings, embedding_dim, cube)
        native = seeded(
            lambda: nn.Embedding(num_embeddings, embedding_dim, padding_idx, dtype=dtype),
            agreed_seed(cube),
        )
        self._build(native, cube)

    @classmethod
    def from_native_module(
        cls, module: nn.Embedding, dims: ParallelDims, *, swapped: bool = False
    ) -> _Embedding:
        """This rank's part of ``module``'s weight, in orientation ``swapped``.

        Raises:
            TypeError: ``module`` is not an ``nn.Embedding``.
            ValueError: ``dims`` is not 3D, the sizes do not divide, or ``module`` uses
                ``max_norm``, ``sparse`` or ``scale_grad_by_freq``.
        """
        native = _native_embedding(module, cls.__name__)
        cube = Cube3D(dims, swapped)
        cls._check(native.num_embeddings, native.embedding_dim, cube)
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._build(native, cube)
        return layer

    @classmethod
    def _check(cls, num_embeddings: int, embedding_dim: int, cube: Cube3D) -> None:
        q = cube.depth
        fix = "choose sizes that divide (pad the vocabulary), or another tensor-parallel size"
        check_split(cls.__name__, "embedding_dim", embedding_dim, q, cube, fix)
        if cls._vocab_parts > 1:
            check_split(cls.__name__, "num_embeddings", num_embeddings, q * q, cube, fix)

    def _build(self, native: nn.Embedding, cube: Cube3D) -> None:
        self.cube = cube
        self.num_embeddings, self.embedding_dim = native.num_embeddings, native.embedding_dim
        self.padding_idx = native.padding_idx
        self.weight = shard_whole(native.weight, cube, self._levels)

    @property
    def swapped(self) -> bool:
        """The orientation of the output."""
        return self.cube.swapped

    @property
    def output_swapped(self) -> bool:
        """The orientation of the output (what the next layer's ``swapped`` is)."""
        return self.cube.swapped

    def extra_repr(self) -> str:
        """Sizes, cube side, orientation and local weight, for ``repr``."""
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, padding_idx={self.padding_idx}, "
            f"q={self.cube.depth}, swapped={self.swapped}, "
            f"local_weight={tuple(self.weight.shape)}"
        )


class Embedding3D(_Embedding):
    """``nn.Embedding`` whose weight columns the output axis splits (replicated elsewhere).

    Args:
        num_embeddings: Vocabulary size.
        embedding_dim: Whole embedding width (divisible by ``q``).
        padding_idx: An id whose row gets no gradient (and starts at zero).
        dtype: Parameter dtype.
        dims: The job's layout, ``tp_mode="3d"``.
        swapped: Orientation of the output.
    """

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The whole batch of ids ``(batch, ...)`` -> ``(batch/q^2, ..., D/q)``."""
        return embedding_3d(ids, self.weight, self.cube, self.padding_idx)


class VocabParallelEmbedding3D(_Embedding):
    """``nn.Embedding`` with the vocabulary split ``q*q`` ways and the width ``q`` ways.

    Args:
        num_embeddings: Vocabulary size (divisible by ``q*q``).
        embedding_dim: Whole embedding width (divisible by ``q``).
        padding_idx: An id whose row gets no gradient (and starts at zero).
        dtype: Parameter dtype.
        dims: The job's layout, ``tp_mode="3d"``.
        swapped: Orientation of the output.
    """

    _levels = _VOCAB
    _vocab_parts = 2

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The whole batch of ids ``(batch, ...)`` -> ``(batch/q^2, ..., D/q)``."""
        return vocab_parallel_embedding_3d(ids, self.weight, self.cube, self.padding_idx)


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


class PatchEmbedding3D(nn.Module):
    """ViT's patch embedding on a 3D cube: patchify, class token, position embedding.

    Parameters (ColossalAI's names): ``weight (D/q, C, p, p)``, ``bias (D/q,)``,
    ``cls_token (1, 1, D/q)``, ``pos_embed (1, patches + 1, D/q)``.

    Args:
        img_size: Image height and width (an int for a square).
        patch_size: Patch height and width (divides ``img_size``).
        in_chans: Image channels.
        embed_size: Whole embedding width (divisible by ``q``).
        flatten: Return ``(n, patches + 1, D/q)`` tokens (False: the convolution's map).
        dtype: Parameter dtype.
        dims: The job's layout, ``tp_mode="3d"``.
        swapped: Orientation of the output.
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
        swapped: bool = False,
    ) -> None:
        super().__init__()
        cube = Cube3D(dims, swapped)
        img, patch = _pair(img_size), _pair(patch_size)
        if img[0] % patch[0] or img[1] % patch[1]:
            raise ValueError(
                f"{type(self).__name__}: img_size={img} is not a multiple of patch_size={patch}"
            )
        self._check(embed_size, cube)
        patches = (img[0] // patch[0]) * (img[1] // patch[1])
        native = seeded(
            lambda: _PatchParams(patches, patch, in_chans, embed_size, dtype), agreed_seed(cube)
        )
        self._build(native, cube, flatten)

    @classmethod
    def from_native_module(
        cls, module: nn.Module, dims: ParallelDims, *, swapped: bool = False
    ) -> PatchEmbedding3D:
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
        cube = Cube3D(dims, swapped)
        cls._check(int(getattr(module, "weight").shape[0]), cube)  # noqa: B009
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._build(module, cube, bool(getattr(module, "flatten", True)))
        return layer

    @classmethod
    def _check(cls, embed_size: int, cube: Cube3D) -> None:
        check_split(
            cls.__name__,
            "embed_size",
            embed_size,
            cube.depth,
            cube,
            "choose a width that divides, or another tensor-parallel size",
        )

    def _build(self, native: nn.Module, cube: Cube3D, flatten: bool) -> None:
        self.cube, self.flatten = cube, flatten
        weight: torch.Tensor = getattr(native, "weight")  # noqa: B009 - typed as a tensor
        self.embed_size, self.in_chans = int(weight.shape[0]), int(weight.shape[1])
        self.patch_size = (int(weight.shape[2]), int(weight.shape[3]))
        self.num_patches = int(getattr(native, "pos_embed").shape[1]) - 1  # noqa: B009
        self.weight = shard_whole(weight, cube, (("output", 0), ("input", None), ("weight", None)))
        bias = getattr(native, "bias", None)
        if bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = shard_whole(bias, cube, (("output", 0), ("input", None), ("weight", None)))
        for name in ("cls_token", "pos_embed"):
            whole: torch.Tensor = getattr(native, name)
            setattr(
                self,
                name,
                shard_whole(whole, cube, (("output", 2), ("input", None), ("weight", None))),
            )

    @property
    def swapped(self) -> bool:
        """The orientation of the output."""
        return self.cube.swapped

    @property
    def output_swapped(self) -> bool:
        """The orientation of the output (what the next layer's ``swapped`` is)."""
        return self.cube.swapped

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """The whole batch ``(batch, C, H, W)`` -> ``(batch/q^2, patches + 1, D/q)``."""
        return patch_embedding_3d(
            images,
            self.weight,
            self.bias,
            self.cls_token,
            self.pos_embed,
            self.cube,
            self.patch_size,
            self.flatten,
        )

    def extra_repr(self) -> str:
        """Sizes, cube side and orientation, for ``repr``."""
        return (
            f"patch_size={self.patch_size}, in_chans={self.in_chans}, "
            f"embed_size={self.embed_size}, num_patches={self.num_patches}, "
            f"q={self.cube.depth}, swapped={self.swapped}"
        )
