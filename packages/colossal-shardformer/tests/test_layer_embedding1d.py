"""Embedding1D (width split, output gathered) against ``nn.Embedding``, alone and tied (gloo)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from colossal.core import CommTracker, sharded_view
from colossal.core.testing import assert_rel_close, distributed_test
from colossal.shardformer.layer import Embedding1D, Linear1D_Row

RTOL = 1e-5
VOCAB, D = 10, 8


@distributed_test(2)
def test_embedding1d_matches_native_and_ties_to_a_row_head(rank: int, world_size: int) -> None:
    """Catches: a slice of the wrong columns (rank order), a missing output gather or its
    backward keeping the wrong slice, a padding row with gradient, a tied row-parallel head
    that would see a different layout than the embedding (its grad sums both uses), and an
    uneven width gloo cannot gather, found only at the first forward."""
    torch.manual_seed(0)
    native = nn.Embedding(VOCAB, D, padding_idx=2)
    layer = Embedding1D.from_native_module(copy.deepcopy(native), None)
    assert tuple(layer.weight.shape) == (VOCAB, D // world_size)
    ids = torch.tensor([[2, 0, 9, 4], [1, 2, 3, 5]])
    ref = native(ids)
    with CommTracker() as fwd:
        out = layer(ids)
    assert fwd.calls() == fwd.calls("all_gather") == 1, fwd.table()
    assert_rel_close(out, ref, RTOL, "Embedding1D output")
    g = torch.randn_like(ref)
    ref.backward(g)
    with CommTracker() as bwd:
        out.backward(g)
    assert bwd.calls() == 0, "the backward keeps this rank's slice, no communication"
    grad = sharded_view(layer.weight.grad, like=layer.weight).gather()
    assert_rel_close(grad, native.weight.grad, RTOL, "Embedding1D weight grad")
    assert float(grad[2].abs().sum()) == 0.0, "the padding_idx row gets no gradient"

    # tied: logits = embed(ids) @ W^T with one Parameter in both layers
    native.weight.grad = None
    head = Linear1D_Row(D, VOCAB, layer.weight, None, None, parallel_input=False)
    layer.weight.grad = None
    logits_ref = nn.functional.linear(native(ids), native.weight)
    logits = head(layer(ids))
    assert_rel_close(logits, logits_ref, RTOL, "tied logits")
    logits_ref.square().mean().backward()
    logits.square().mean().backward()
    grad = sharded_view(layer.weight.grad, like=layer.weight).gather()
    assert_rel_close(grad, native.weight.grad, RTOL, "tied weight grad")

    with pytest.raises(ValueError, match="embedding_dim=5"):
        Embedding1D.from_native_module(nn.Embedding(4, 5), None)
