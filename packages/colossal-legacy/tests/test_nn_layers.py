"""colossalai.nn's mode-dispatched layers: the seed pages' MLP shapes, equality with torch.

One distributed test per world size (1D at world 2, 2D at 4, 2.5D and 3D at 8), each
running several checks: the pages' printed shapes, the pages' input partitioning against
the layers' own split, outputs, every gradient, ``state_dict`` and an SGD step against the
plain torch model with the same weights, and the losses of each mode.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _nn_layer_cases import (
    PLAIN,
    EmbeddingTiedModel,
    SeedMLP,
    TinyViT,
    TokenModel,
    check_against_plain,
    seed_partition,
)
from torch import nn

import colossal.legacy.nn as col_nn
from colossal.core.testing import distributed_test
from colossal.legacy import init_context
from colossal.legacy.core import gpc
from colossal.shardformer.layer import (
    Dropout2D,
    Embedding1D,
    Linear1D_Col,
    Linear1D_Row,
    Linear2D,
    Linear2p5D,
    Linear3D,
    split_input_2d,
    split_input_2p5d,
    split_input_3d,
)

# The pages' prints: weights in ColossalAI's [in, out] layout, activations of this rank.
PAGE_SHAPES = {
    "1d": dict(weight_1=(256, 512), weight_2=(512, 256), input=(16, 256),
               output_1=(16, 512), output_2=(16, 256)),
    "2d": dict(weight_1=(128, 512), weight_2=(512, 128), input=(8, 128),
               output_1=(8, 512), output_2=(8, 128)),
    "2.5d": dict(weight_1=(128, 512), weight_2=(512, 128), input=(4, 128),
                 output_1=(4, 512), output_2=(4, 128)),
    "3d": dict(weight_1=(128, 256), weight_2=(512, 64), input=(4, 128),
               output_1=(4, 512), output_2=(4, 128)),
}  # fmt: skip
SPLIT = {
    "2d": lambda x: split_input_2d(x, gpc.dims),
    "2.5d": lambda x: split_input_2p5d(x, gpc.dims),
    "3d": lambda x: split_input_3d(x, gpc.dims),
}


def _launch(tensor: dict | None) -> None:
    init_context(dict(parallel=dict(tensor=tensor)) if tensor else {}, verbose=False)


def _seed_mlp(mode: str) -> None:
    """The page's MLP: its shapes, and the same outputs and gradients as torch's MLP."""
    torch.manual_seed(1)
    x = torch.randn(16, 256)
    upstream = torch.randn(16, 256)
    part = seed_partition(x)
    if mode in SPLIT:  # the page's partitioning is the layers' own
        torch.testing.assert_close(part, SPLIT[mode](x), rtol=0, atol=0)

    def run(model: nn.Module, parallel: bool) -> torch.Tensor:
        if not parallel:
            return (model(x) * upstream).sum()
        local = (model(part) * seed_partition(upstream)).sum()
        if mode == "1d":  # the output is whole on every rank
            return local
        total = local.detach().clone()  # split: the whole sum is the sum of the parts
        dist.all_reduce(total)
        return local + (total - local.detach())  # its value, this rank's gradient

    model = check_against_plain(SeedMLP, run)
    assert model.shapes == PAGE_SHAPES[mode]


def _tiny_vit() -> None:
    """PatchEmbedding, LayerNorm, Linear, Classifier and CrossEntropyLoss against torch's."""
    torch.manual_seed(2)
    images, labels = torch.randn(8, 3, 8, 8), torch.randint(0, 5, (8,))

    def run(model: nn.Module, parallel: bool) -> torch.Tensor:
        gpc_loss = col_nn.CrossEntropyLoss(label_smoothing=0.1) if parallel else None
        if gpc_loss is None:
            return nn.functional.cross_entropy(model(images), labels, label_smoothing=0.1)
        return gpc_loss(model(images), labels)

    check_against_plain(TinyViT, run)


def _token_model() -> None:
    """VocabParallelEmbedding, tied VocabParallelClassifier, VocabParallelCrossEntropyLoss."""
    torch.manual_seed(3)
    ids, labels = torch.randint(0, 16, (8, 3)), torch.randint(0, 16, (8, 3))

    def run(model: nn.Module, parallel: bool) -> torch.Tensor:
        if not parallel:
            return nn.functional.cross_entropy(model(ids).flatten(0, 1), labels.flatten())
        return col_nn.VocabParallelCrossEntropyLoss()(model(ids), labels)

    model = check_against_plain(TokenModel, run)
    assert model.head.weight is model.embed.weight


def _embedding_tied_1d() -> None:
    """1D Embedding (width split) and a Classifier tied to it, against torch's."""
    torch.manual_seed(4)
    ids = torch.randint(0, 16, (8, 3))
    labels = torch.randint(0, 16, (8, 3))

    def run(model: nn.Module, parallel: bool) -> torch.Tensor:
        return nn.functional.cross_entropy(model(ids).flatten(0, 1), labels.flatten())

    model = check_against_plain(EmbeddingTiedModel, run)
    assert type(model.embed) is Embedding1D and type(model.head) is Linear1D_Row
    assert model.head.weight is model.embed.weight and model.embed.weight.shape == (16, 4)


def _mode_checks(tensor: dict) -> None:
    _launch(tensor)
    mode = tensor["mode"]
    _seed_mlp(mode)
    _tiny_vit()
    _token_model()
    gpc.destroy()


@distributed_test(2)
def test_none_and_1d_layers(rank: int, world_size: int) -> None:
    _launch(None)
    layers = SeedMLP()
    assert type(layers.dense_1) is nn.Linear and type(layers.dropout) is nn.Dropout
    assert isinstance(layers.dense_1, col_nn.Linear) and isinstance(layers.dropout, col_nn.Dropout)
    assert type(col_nn.PatchEmbedding(8, 4, 3, 16)) is PLAIN.PatchEmbedding
    gpc.destroy()

    _launch(dict(size=2, mode="1d"))
    mlp = SeedMLP()  # column then row, as the page prints
    assert type(mlp.dense_1) is Linear1D_Col and type(mlp.dense_2) is Linear1D_Row
    assert not gpc.layer_env.parallel_input
    _embedding_tied_1d()
    gpc.destroy()
    _mode_checks(dict(size=2, mode="1d"))


@distributed_test(4)
def test_2d_layers(rank: int, world_size: int) -> None:
    _launch(dict(size=4, mode="2d"))
    mlp = SeedMLP()
    assert type(mlp.dense_1) is Linear2D and type(mlp.dropout) is Dropout2D
    with pytest.raises(ValueError, match="not divisible"):
        col_nn.Linear(5, 8)
    named = col_nn.layer.Linear2D(8, 12)  # the seeds' `from colossalai.nn import Linear2D`
    assert tuple(named.weight.shape) == (6, 4) and named.state_dict()["weight"].shape == (12, 8)
    gpc.destroy()
    _mode_checks(dict(size=4, mode="2d"))


@distributed_test(8)
def test_2p5d_and_3d_layers(rank: int, world_size: int) -> None:
    _launch(dict(size=8, mode="2.5d", depth=2))
    assert type(col_nn.Linear(8, 8)) is Linear2p5D
    gpc.destroy()
    _mode_checks(dict(size=8, mode="2.5d", depth=2))
    _launch(dict(size=8, mode="3d"))
    first, second = col_nn.Linear(8, 16), col_nn.Linear(16, 8)
    assert type(first) is Linear3D and (first.swapped, second.swapped) == (False, True)
    assert not gpc.layer_env.swapped_3d  # two linears: back to the first orientation
    gpc.destroy()
    _mode_checks(dict(size=8, mode="3d"))
