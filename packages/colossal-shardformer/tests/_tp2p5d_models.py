"""Plain single-process models and their 2.5D-parallel copies for the tp2p5d tests.

Each plain model is ordinary torch; ``shard_*`` returns a deep copy whose layers are replaced
by the 2.5D layers' ``from_native_module`` (same attribute names, so the same ``forward``,
parameter names and state-dict keys).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F  # noqa: N812 - the usual alias
from torch import nn

from colossal.core import ParallelDims
from colossal.shardformer.layer.tp2p5d import (
    Classifier2p5D,
    Embedding2p5D,
    LayerNorm2p5D,
    Linear2p5D,
    PatchEmbedding2p5D,
    VocabParallelClassifier2p5D,
    VocabParallelEmbedding2p5D,
)

__all__ = [
    "PlainPatchEmbedding",
    "TokenModel",
    "VisionModel",
    "shard_token_model",
    "shard_vision_model",
]


class TokenModel(nn.Module):
    """Embedding, LayerNorm, a residual GELU MLP, LayerNorm, a head tied to the embedding."""

    def __init__(self, vocab: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.norm1 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.norm1(self.embed(ids))
        x = x + self.fc2(F.gelu(self.fc1(x)))
        return self.head(self.norm2(x))


def shard_token_model(plain: TokenModel, dims: ParallelDims, vocab_parallel: bool) -> nn.Module:
    """The 2.5D copy: (VocabParallel)Embedding2p5D ... (VocabParallel)Classifier2p5D, tied."""
    model = copy.deepcopy(plain)
    emb_cls = VocabParallelEmbedding2p5D if vocab_parallel else Embedding2p5D
    head_cls = VocabParallelClassifier2p5D if vocab_parallel else Classifier2p5D
    model.embed = emb_cls.from_native_module(plain.embed, dims)
    model.norm1 = LayerNorm2p5D.from_native_module(plain.norm1, dims)
    model.fc1 = Linear2p5D.from_native_module(plain.fc1, dims)
    model.fc2 = Linear2p5D.from_native_module(plain.fc2, dims)
    model.norm2 = LayerNorm2p5D.from_native_module(plain.norm2, dims)
    model.head = head_cls.from_native_module(plain.head, dims, weight=model.embed.weight)
    return model


class PlainPatchEmbedding(nn.Module):
    """ColossalAI's ``VanillaPatchEmbedding``: conv patchify, class token, position embedding."""

    def __init__(self, img: int, patch: int, chans: int, dim: int) -> None:
        super().__init__()
        conv = nn.Conv2d(chans, dim, patch, stride=patch)
        self.patch = patch
        self.weight, self.bias = conv.weight, conv.bias
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, (img // patch) ** 2 + 1, dim))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        y = F.conv2d(images, self.weight, self.bias, stride=self.patch).flatten(2).transpose(1, 2)
        y = torch.cat([self.cls_token.expand(y.shape[0], -1, -1), y], dim=1)
        return y + self.pos_embed


class VisionModel(nn.Module):
    """Patch embedding, LayerNorm, a residual GELU MLP, classifier on the class token."""

    def __init__(self, img: int, patch: int, chans: int, dim: int, classes: int) -> None:
        super().__init__()
        self.patch_embed = PlainPatchEmbedding(img, patch, chans, dim)
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images)
        x = x + self.fc2(F.gelu(self.fc1(self.norm(x))))
        return self.head(x[:, 0])


def shard_vision_model(plain: VisionModel, dims: ParallelDims) -> nn.Module:
    """The 2.5D copy: PatchEmbedding2p5D, LayerNorm2p5D, two Linear2p5D, Classifier2p5D."""
    model = copy.deepcopy(plain)
    model.patch_embed = PatchEmbedding2p5D.from_native_module(plain.patch_embed, dims)
    model.norm = LayerNorm2p5D.from_native_module(plain.norm, dims)
    model.fc1 = Linear2p5D.from_native_module(plain.fc1, dims)
    model.fc2 = Linear2p5D.from_native_module(plain.fc2, dims)
    model.head = Classifier2p5D.from_native_module(plain.head, dims)
    return model
