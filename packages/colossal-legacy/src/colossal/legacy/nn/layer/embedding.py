"""``Embedding``, ``VocabParallelEmbedding`` and ``PatchEmbedding`` of ``colossalai.nn``.

==============  =====================  ============================  =========================
mode            ``Embedding``          ``VocabParallelEmbedding``    ``PatchEmbedding``
==============  =====================  ============================  =========================
None, sequence  ``nn.Embedding``       ``nn.Embedding``              ``VanillaPatchEmbedding``
``'1d'``        ``Embedding1D``        ``VocabParallelEmbedding1D``  ``VanillaPatchEmbedding``
``'2d'``        ``Embedding2D``        ``VocabParallelEmbedding2D``  ``PatchEmbedding2D``
``'2.5d'``      ``Embedding2p5D``      ``VocabParallelEmbedding2p5D``  ``PatchEmbedding2p5D``
``'3d'``        ``Embedding3D``        ``VocabParallelEmbedding3D``  ``PatchEmbedding3D``
==============  =====================  ============================  =========================

In ``'1d'`` an ``Embedding`` splits its width over the ranks and gathers its output whole,
as ColossalAI's ``Embedding1D`` did; a ``Classifier`` tied to it is row-parallel over the
same parameter. The 2D/2.5D/3D
embeddings read the whole batch (ids or images, the same on every rank) and return this
rank's block of the embedded activation.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from colossal.legacy.nn.layer._dispatch import (
    ModeDispatch,
    agreed,
    grid_dims,
    layer_env,
    tensor_mode,
    tp_group_1d,
    whole_state,
)
from colossal.legacy.nn.layer._native import Initializer
from colossal.shardformer.layer import (
    Embedding1D,
    Embedding2D,
    Embedding2p5D,
    Embedding3D,
    PatchEmbedding2D,
    PatchEmbedding2p5D,
    PatchEmbedding3D,
    VocabParallelEmbedding1D,
    VocabParallelEmbedding2D,
    VocabParallelEmbedding2p5D,
    VocabParallelEmbedding3D,
)

__all__ = ["Embedding", "PatchEmbedding", "VanillaPatchEmbedding", "VocabParallelEmbedding"]


def _pair(value: int | tuple[int, int]) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


class VanillaPatchEmbedding(nn.Module):
    """ViT's patch embedding without tensor parallelism (ColossalAI's parameter names).

    ``weight (D, C, p, p)`` and ``bias (D,)`` of the patchifying convolution, ``cls_token
    (1, 1, D)`` (zeros) and ``pos_embed (1, patches + 1, D)`` (truncated normal, std 0.02):
    the layout the 2D/2.5D/3D patch embeddings shard, so state dicts move between modes.

    Args:
        img_size: Image height and width (an int for a square).
        patch_size: Patch height and width.
        in_chans: Image channels.
        embed_size: Embedding width.
        dtype: Parameter dtype.
        flatten: Return ``(n, patches + 1, D)`` tokens (False: the convolution's map).
    """

    def __init__(
        self,
        img_size: int | tuple[int, int],
        patch_size: int | tuple[int, int],
        in_chans: int,
        embed_size: int,
        dtype: torch.dtype | None = None,
        flatten: bool = True,
    ) -> None:
        super().__init__()
        img, patch = _pair(img_size), _pair(patch_size)
        if img[0] % patch[0] or img[1] % patch[1]:
            raise ValueError(f"PatchEmbedding: img_size={img} is not a multiple of {patch}")
        patches = (img[0] // patch[0]) * (img[1] // patch[1])
        conv = nn.Conv2d(in_chans, embed_size, patch, stride=patch, dtype=dtype)
        self.weight, self.bias = conv.weight, conv.bias
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_size, dtype=dtype))
        pos = torch.empty(1, patches + 1, embed_size, dtype=dtype)
        self.pos_embed = nn.Parameter(nn.init.trunc_normal_(pos, std=0.02))
        self.patch_size, self.flatten = patch, flatten

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """``(n, C, H, W)`` -> ``(n, patches + 1, D)`` (or the map when not flattening)."""
        y = nn.functional.conv2d(images, self.weight, self.bias, stride=self.patch_size)
        if not self.flatten:
            return y
        y = y.flatten(2).transpose(1, 2)
        y = torch.cat([self.cls_token.expand(y.shape[0], -1, -1), y], dim=1)
        return y + self.pos_embed


def _native_embedding(
    num_embeddings: int,
    embedding_dim: int,
    padding_idx: int | None,
    dtype: torch.dtype | None,
    weight_initializer: Initializer | None,
    kwargs: dict[str, Any],
) -> nn.Embedding:
    emb = nn.Embedding(num_embeddings, embedding_dim, padding_idx, dtype=dtype, **kwargs)
    if weight_initializer is not None:
        with torch.no_grad():
            weight_initializer(emb.weight, fan_in=num_embeddings, fan_out=embedding_dim)
            if padding_idx is not None:
                emb.weight[padding_idx].zero_()
    return emb


class Embedding(metaclass=ModeDispatch):
    """``colossalai.nn.Embedding``: a token embedding of the config's tensor mode.

    Above ``vocab_parallel_limit`` tokens (with tensor parallelism) it is a
    :class:`VocabParallelEmbedding`, as in ColossalAI.

    Args:
        num_embeddings: Vocabulary size.
        embedding_dim: Embedding width.
        padding_idx: An id whose row gets no gradient.
        dtype: Parameter dtype.
        weight_initializer: ColossalAI-style initializer of the whole weight.
        vocab_parallel_limit: The most tokens of a non-vocab-parallel embedding.
        **kwargs: Further ``nn.Embedding`` arguments (without tensor parallelism).
    """

    _kinds = (nn.Embedding, Embedding1D, Embedding2D, Embedding2p5D, Embedding3D)

    def __new__(  # type: ignore[misc]
        cls,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        dtype: torch.dtype | None = None,
        weight_initializer: Initializer | None = None,
        vocab_parallel_limit: int = 2048,
        **kwargs: Any,
    ) -> nn.Module:
        """The module of the config's tensor mode (see the class docstring)."""
        mode = tensor_mode("Embedding")
        args = (num_embeddings, embedding_dim, padding_idx, dtype, weight_initializer)
        if mode in (None, "sequence"):
            return _native_embedding(*args, kwargs)
        if num_embeddings > vocab_parallel_limit:
            return VocabParallelEmbedding(*args, **kwargs)
        native = agreed(lambda: _native_embedding(*args, kwargs), grid_dims().group("tp"))
        dims = grid_dims()
        if mode == "1d":
            return whole_state(Embedding1D.from_native_module(native, tp_group_1d()))
        if mode == "2d":
            return whole_state(Embedding2D.from_native_module(native, dims))
        if mode == "2.5d":
            return whole_state(Embedding2p5D.from_native_module(native, dims))
        swapped = layer_env().swapped_3d
        return whole_state(Embedding3D.from_native_module(native, dims, swapped=swapped))


class VocabParallelEmbedding(metaclass=ModeDispatch):
    """``colossalai.nn.VocabParallelEmbedding``: the vocabulary split over the ranks.

    Args:
        num_embeddings: Vocabulary size.
        embedding_dim: Embedding width.
        padding_idx: An id whose row gets no gradient.
        dtype: Parameter dtype.
        weight_initializer: ColossalAI-style initializer of the whole weight.
        **kwargs: Further ``nn.Embedding`` arguments (without tensor parallelism).
    """

    _kinds = (
        nn.Embedding,
        VocabParallelEmbedding1D,
        VocabParallelEmbedding2D,
        VocabParallelEmbedding2p5D,
        VocabParallelEmbedding3D,
    )

    def __new__(  # type: ignore[misc]
        cls,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        dtype: torch.dtype | None = None,
        weight_initializer: Initializer | None = None,
        **kwargs: Any,
    ) -> nn.Module:
        """The module of the config's tensor mode (see the class docstring)."""
        mode = tensor_mode("VocabParallelEmbedding")
        args = (num_embeddings, embedding_dim, padding_idx, dtype, weight_initializer)
        if mode in (None, "sequence"):
            return _native_embedding(*args, kwargs)
        native = agreed(lambda: _native_embedding(*args, kwargs), grid_dims().group("tp"))
        dims = grid_dims()
        if mode == "1d":
            layer = VocabParallelEmbedding1D.from_native_module(
                native, tp_group_1d(), make_vocab_size_divisible_by=1
            )
            return whole_state(layer)
        if mode == "2d":
            return whole_state(VocabParallelEmbedding2D.from_native_module(native, dims))
        if mode == "2.5d":
            return whole_state(VocabParallelEmbedding2p5D.from_native_module(native, dims))
        swapped = layer_env().swapped_3d
        return whole_state(
            VocabParallelEmbedding3D.from_native_module(native, dims, swapped=swapped)
        )


class PatchEmbedding(metaclass=ModeDispatch):
    """``colossalai.nn.PatchEmbedding``: ViT's patchify, class token and positions, by mode.

    The 2D/2.5D/3D modules take the whole batch of images and return this rank's block of
    the tokens; the others return all tokens.

    Args:
        img_size: Image height and width (an int for a square).
        patch_size: Patch height and width.
        in_chans: Image channels.
        embed_size: Embedding width.
        dtype: Parameter dtype.
        flatten: Return tokens (False: the convolution's map).
        weight_initializer: ColossalAI-style initializer of the convolution's kernel.
        bias_initializer: The same for its bias.
        position_embed_initializer: The same for the position embedding.
    """

    _kinds = (VanillaPatchEmbedding, PatchEmbedding2D, PatchEmbedding2p5D, PatchEmbedding3D)

    def __new__(  # type: ignore[misc]
        cls,
        img_size: int | tuple[int, int],
        patch_size: int | tuple[int, int],
        in_chans: int,
        embed_size: int,
        dtype: torch.dtype | None = None,
        flatten: bool = True,
        weight_initializer: Initializer | None = None,
        bias_initializer: Initializer | None = None,
        position_embed_initializer: Initializer | None = None,
    ) -> nn.Module:
        """The module of the config's tensor mode (see the class docstring)."""
        mode = tensor_mode("PatchEmbedding")

        def build() -> VanillaPatchEmbedding:
            native = VanillaPatchEmbedding(
                img_size, patch_size, in_chans, embed_size, dtype, flatten
            )
            fan_in = in_chans * native.weight.shape[2] * native.weight.shape[3]
            with torch.no_grad():
                if weight_initializer is not None:
                    weight_initializer(native.weight, fan_in=fan_in, fan_out=embed_size)
                if bias_initializer is not None and native.bias is not None:
                    bias_initializer(native.bias, fan_in=fan_in)
                if position_embed_initializer is not None:
                    position_embed_initializer(native.pos_embed)
            return native

        if mode in (None, "sequence"):
            return build()
        native = agreed(build, grid_dims().group("tp"))
        dims = grid_dims()
        if mode == "1d":
            return native
        if mode == "2d":
            return whole_state(PatchEmbedding2D.from_native_module(native, dims))
        if mode == "2.5d":
            return whole_state(PatchEmbedding2p5D.from_native_module(native, dims))
        swapped = layer_env().swapped_3d
        return whole_state(PatchEmbedding3D.from_native_module(native, dims, swapped=swapped))
