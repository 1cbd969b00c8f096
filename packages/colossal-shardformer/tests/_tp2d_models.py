"""2D-parallel copies of the plain test models (the plain ones are shared with the 3D tests).

``shard_*`` returns a deep copy of the plain model whose layers are replaced by the 2D
layers' ``from_native_module`` (same attribute names, hence the same ``forward``, parameter
names and state-dict keys), and ``gather_logits`` the whole logits of such a copy.
"""

from __future__ import annotations

import copy

import torch
from _tp3d_models import TokenModel, VisionModel
from torch import nn

from colossal.core import ParallelDims
from colossal.shardformer.layer.tp2d import (
    Classifier2D,
    Embedding2D,
    LayerNorm2D,
    Linear2D,
    PatchEmbedding2D,
    VocabParallelClassifier2D,
    VocabParallelEmbedding2D,
    gather_batch_2d,
    gather_output_2d,
)

__all__ = [
    "TokenModel",
    "VisionModel",
    "gather_logits",
    "shard_token_model",
    "shard_vision_model",
]


def shard_token_model(plain: TokenModel, dims: ParallelDims, vocab_parallel: bool) -> nn.Module:
    """The 2D copy: (VocabParallel)Embedding2D ... (VocabParallel)Classifier2D, tied."""
    model = copy.deepcopy(plain)
    emb_cls = VocabParallelEmbedding2D if vocab_parallel else Embedding2D
    head_cls = VocabParallelClassifier2D if vocab_parallel else Classifier2D
    model.embed = emb_cls.from_native_module(plain.embed, dims)
    model.norm1 = LayerNorm2D.from_native_module(plain.norm1, dims)
    model.fc1 = Linear2D.from_native_module(plain.fc1, dims)
    model.fc2 = Linear2D.from_native_module(plain.fc2, dims)
    model.norm2 = LayerNorm2D.from_native_module(plain.norm2, dims)
    model.head = head_cls.from_native_module(plain.head, dims, weight=model.embed.weight)
    return model


def shard_vision_model(plain: VisionModel, dims: ParallelDims) -> nn.Module:
    """The 2D copy: PatchEmbedding2D, LayerNorm2D, two Linear2D, Classifier2D."""
    model = copy.deepcopy(plain)
    model.patch_embed = PatchEmbedding2D.from_native_module(plain.patch_embed, dims)
    model.norm = LayerNorm2D.from_native_module(plain.norm, dims)
    model.fc1 = Linear2D.from_native_module(plain.fc1, dims)
    model.fc2 = Linear2D.from_native_module(plain.fc2, dims)
    model.head = Classifier2D.from_native_module(plain.head, dims)
    return model


def gather_logits(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """The whole logits of a 2D copy (vocab-parallel blocks or replicated rows)."""
    logits = model(batch)
    head = model.head
    dims = head.grid.dims
    if isinstance(head, VocabParallelClassifier2D):
        return gather_output_2d(logits, dims)
    return gather_batch_2d(logits, dims)
