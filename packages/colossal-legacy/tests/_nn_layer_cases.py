"""Checks of the mode-dispatched ``colossalai.nn`` layers against plain torch models.

Each check builds a model from ``colossal.legacy.nn`` layers under the launched config and
the same model from torch modules, loads the plain model's state dict into the first,
and compares outputs, every gradient, ``state_dict()`` and one SGD step.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import torch
from torch import nn

import colossal.legacy.nn as col_nn
from colossal.legacy.context import ParallelMode
from colossal.legacy.core import gpc
from colossal.legacy.nn.layer import VanillaPatchEmbedding
from colossal.shardformer.layer import local_part

__all__ = [
    "PLAIN",
    "EmbeddingTiedModel",
    "SeedMLP",
    "TinyViT",
    "TokenModel",
    "check_against_plain",
    "seed_partition",
]

TOL = dict(atol=2e-5, rtol=1e-4)


def _plain_head(
    in_features: int, num_classes: int, weight: nn.Parameter | None = None, bias: bool = True
) -> nn.Linear:
    head = nn.Linear(in_features, num_classes, bias=bias)
    if weight is not None:
        head.weight = weight
    return head


#: The plain torch layers under ``colossalai.nn``'s names (what the modes must equal).
PLAIN = SimpleNamespace(
    Linear=nn.Linear,
    LayerNorm=nn.LayerNorm,
    Dropout=nn.Dropout,
    Embedding=nn.Embedding,
    VocabParallelEmbedding=nn.Embedding,
    Classifier=_plain_head,
    VocabParallelClassifier=_plain_head,
    PatchEmbedding=VanillaPatchEmbedding,
)


class SeedMLP(nn.Module):
    """The tensor parallel pages' MLP; ``shapes`` records what the pages print."""

    def __init__(self, layers: object = col_nn, dim: int = 256) -> None:
        super().__init__()
        intermediate_dim = dim * 4
        self.dense_1 = layers.Linear(dim, intermediate_dim)  # type: ignore[attr-defined]
        self.activation = nn.GELU()
        self.dense_2 = layers.Linear(intermediate_dim, dim)  # type: ignore[attr-defined]
        self.dropout = layers.Dropout(0.1)  # type: ignore[attr-defined]
        # ColossalAI's [in, out] layout of the local weights, as the pages print them.
        self.shapes: dict[str, tuple[int, ...]] = {
            "weight_1": tuple(self.dense_1.weight.t().shape),
            "weight_2": tuple(self.dense_2.weight.t().shape),
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.shapes["input"] = tuple(x.shape)
        x = self.dense_1(x)
        self.shapes["output_1"] = tuple(x.shape)
        x = self.activation(x)
        x = self.dense_2(x)
        self.shapes["output_2"] = tuple(x.shape)
        return self.dropout(x)


class TinyViT(nn.Module):
    """Patch embedding, a pre-norm MLP block, norm, the class token's logits."""

    def __init__(self, layers: object = col_nn, dim: int = 16, classes: int = 5) -> None:
        super().__init__()
        c = layers
        self.embed = c.PatchEmbedding(8, 4, 3, dim)  # type: ignore[attr-defined]
        self.norm1 = c.LayerNorm(dim)  # type: ignore[attr-defined]
        self.fc1 = c.Linear(dim, 2 * dim)  # type: ignore[attr-defined]
        self.fc2 = c.Linear(2 * dim, dim)  # type: ignore[attr-defined]
        self.norm2 = c.LayerNorm(dim)  # type: ignore[attr-defined]
        self.head = c.Classifier(dim, classes)  # type: ignore[attr-defined]

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.embed(images)
        x = x + self.fc2(nn.functional.gelu(self.fc1(self.norm1(x))))
        return self.head(self.norm2(x)[:, 0])


class TokenModel(nn.Module):
    """Vocab-parallel embedding, two linears, the tied vocab-parallel classifier."""

    def __init__(self, layers: object = col_nn, vocab: int = 16, dim: int = 8) -> None:
        super().__init__()
        c = layers
        self.embed = c.VocabParallelEmbedding(vocab, dim)  # type: ignore[attr-defined]
        self.fc1 = c.Linear(dim, 2 * dim)  # type: ignore[attr-defined]
        self.fc2 = c.Linear(2 * dim, dim)  # type: ignore[attr-defined]
        self.head = c.VocabParallelClassifier(  # type: ignore[attr-defined]
            dim, vocab, weight=self.embed.weight
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        return self.head(x + self.fc2(torch.tanh(self.fc1(x))))


class EmbeddingTiedModel(nn.Module):
    """Embedding, two linears, a classifier tied to the embedding (ColossalAI's GPT head)."""

    def __init__(self, layers: object = col_nn, vocab: int = 16, dim: int = 8) -> None:
        super().__init__()
        c = layers
        self.embed = c.Embedding(vocab, dim)  # type: ignore[attr-defined]
        self.fc1 = c.Linear(dim, 2 * dim)  # type: ignore[attr-defined]
        self.fc2 = c.Linear(2 * dim, dim)  # type: ignore[attr-defined]
        self.head = c.Classifier(dim, vocab, weight=self.embed.weight)  # type: ignore[attr-defined]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        return self.head(x + self.fc2(torch.tanh(self.fc1(x))))


def seed_partition(x: torch.Tensor) -> torch.Tensor:
    """This rank's part of a whole activation, by the seed pages' code for the mode."""
    mode = gpc.tensor_parallel_mode
    rank = gpc.get_local_rank
    if mode == "2d":
        x = torch.chunk(x, 2, dim=0)[rank(ParallelMode.PARALLEL_2D_COL)]
        return torch.chunk(x, 2, dim=-1)[rank(ParallelMode.PARALLEL_2D_ROW)]
    if mode == "2.5d":
        x = torch.chunk(x, 2, dim=0)[rank(ParallelMode.PARALLEL_2P5D_DEP)]
        x = torch.chunk(x, 2, dim=0)[rank(ParallelMode.PARALLEL_2P5D_COL)]
        return torch.chunk(x, 2, dim=-1)[rank(ParallelMode.PARALLEL_2P5D_ROW)]
    if mode == "3d":
        x = torch.chunk(x, 2, dim=0)[rank(ParallelMode.PARALLEL_3D_WEIGHT)]
        x = torch.chunk(x, 2, dim=0)[rank(ParallelMode.PARALLEL_3D_INPUT)]
        return torch.chunk(x, 2, dim=-1)[rank(ParallelMode.PARALLEL_3D_OUTPUT)]
    return x


def _same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert tuple(got[key].shape) == tuple(value.shape), key
        torch.testing.assert_close(got[key], value, **TOL, msg=key)


def check_against_plain(
    build: Callable[[object], nn.Module],
    run: Callable[[nn.Module, bool], torch.Tensor],
) -> nn.Module:
    """Build both models, load the plain state, compare loss, gradients, state and a step.

    Args:
        build: ``build(layers)`` -> a model of ``layers`` (``colossal.legacy.nn`` or
            :data:`PLAIN`).
        run: ``run(model, parallel)`` -> the scalar to differentiate (``parallel``: the
            model takes this rank's part of the input).

    Returns:
        The parallel model.
    """
    gpc.layer_env.reset()
    model = build(col_nn)
    torch.manual_seed(0)
    plain = build(PLAIN)
    model.load_state_dict(plain.state_dict())
    _same_state(model.state_dict(), plain.state_dict())
    model.eval()  # dropout off: the outputs must be equal
    plain.eval()
    got, want = run(model, True), run(plain, False)
    torch.testing.assert_close(got, want, **TOL)
    got.backward()
    want.backward()
    wanted = dict(plain.named_parameters())
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        whole = wanted[name].grad
        assert whole is not None, name
        torch.testing.assert_close(param.grad, local_part(param, whole), **TOL, msg=name)
    for m in (model, plain):
        torch.optim.SGD(m.parameters(), lr=0.5).step()
    _same_state(model.state_dict(), plain.state_dict())
    return model
