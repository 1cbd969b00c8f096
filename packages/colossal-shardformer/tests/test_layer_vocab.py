"""Vocab-parallel embedding, LM head, cross entropy, causal loss_fn and seeded dropout (gloo).

The vocabulary (100) is never a multiple of ``make_vocab_size_divisible_by * tp``, so every
case runs with padding rows/columns (at TP 4 with the default 64 two ranks hold only padding).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 - the usual alias
from torch import nn

from colossal.core import CommTracker, sharded_view
from colossal.core.comm import all_gather_object
from colossal.core.testing import assert_rel_close, distributed_test
from colossal.shardformer.layer import (
    DropoutForParallelInput,
    DropoutForReplicatedInput,
    VocabParallelEmbedding1D,
    VocabParallelLMHead1D,
    causal_lm_loss_fn,
    cross_entropy_1d,
)

RTOL = 1e-5
VOCAB, D = 100, 8


def _gathered_grad(p: torch.Tensor) -> torch.Tensor:
    return sharded_view(p.grad, like=p).gather()


def _local_cols(full: torch.Tensor, padded: int) -> torch.Tensor:
    """This rank's columns of ``full`` (..., VOCAB) padded with zeros to ``padded``."""
    tp, rank = dist.get_world_size(), dist.get_rank()
    per = padded // tp
    wide = F.pad(full, (0, padded - full.shape[-1]))
    return wide[..., rank * per : (rank + 1) * per]


def _check_embedding(divisible_by: int) -> None:
    native = nn.Embedding(VOCAB, D, padding_idx=3)
    layer = VocabParallelEmbedding1D.from_native_module(
        copy.deepcopy(native), None, make_vocab_size_divisible_by=divisible_by
    )
    tp = dist.get_world_size()
    assert layer.padded_vocab_size % (divisible_by * tp) == 0 < layer.padded_vocab_size - VOCAB
    assert layer.num_embeddings == layer.vocab_size == VOCAB and layer.padding_idx == 3
    ids = torch.randint(0, VOCAB, (3, 7))
    ids[0, :3] = torch.tensor([3, 0, VOCAB - 1])
    ref = native(ids)
    with CommTracker() as fwd:
        out = layer(ids)
    assert fwd.calls() == fwd.calls("all_reduce") == 1, fwd.table()
    assert_rel_close(out, ref, RTOL, f"embedding({divisible_by}) output")
    g = torch.randn_like(ref)
    ref.backward(g)
    out.backward(g)
    grad = _gathered_grad(layer.weight)
    assert_rel_close(grad, native.weight.grad, RTOL, f"embedding({divisible_by}) grad")
    assert float(grad[3].abs().sum()) == 0.0, "the padding_idx row gets no gradient"


def _check_lm_head(gather: bool, bias: bool) -> None:
    native = nn.Linear(D, VOCAB, bias=bias)
    layer = VocabParallelLMHead1D.from_native_module(
        copy.deepcopy(native), None, gather_output=gather
    )
    name = f"lm_head(gather={gather}, bias={bias})"
    x = torch.randn(2, 5, D)
    x_ref, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    labels = torch.randint(0, VOCAB, (2, 5))
    labels[1, :2] = -100
    logits_ref = native(x_ref)
    F.cross_entropy(logits_ref.reshape(-1, VOCAB), labels.reshape(-1)).backward()
    logits = layer(x_tp)
    if gather:
        assert logits.shape[-1] == VOCAB, "users never see the padding columns"
        assert_rel_close(logits, logits_ref, RTOL, f"{name} logits")
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
    else:
        expected = _local_cols(logits_ref, layer.padded_vocab_size)
        assert_rel_close(logits, expected, RTOL, f"{name} local logits")
        loss = cross_entropy_1d(logits, labels, None, vocab_size=VOCAB)
    with CommTracker() as bwd:
        loss.backward()
    assert bwd.calls() == bwd.calls("all_reduce") == 1, bwd.table()
    assert_rel_close(x_tp.grad, x_ref.grad, RTOL, f"{name} input grad")
    assert_rel_close(_gathered_grad(layer.weight), native.weight.grad, RTOL, f"{name} w grad")
    if bias:
        assert_rel_close(_gathered_grad(layer.bias), native.bias.grad, RTOL, f"{name} b grad")


class _TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(ids)))


def _check_tied(gather: bool) -> None:
    native = _TinyLM()
    model = copy.deepcopy(native)
    model.embed = VocabParallelEmbedding1D.from_native_module(model.embed, None)
    model.head = VocabParallelLMHead1D.from_native_module(model.head, None, gather_output=gather)
    assert model.head.weight is model.embed.weight, "tied weights stay one Parameter"
    assert len(list(model.parameters())) == 3
    ids = torch.randint(0, VOCAB, (2, 6))
    labels = ids.clone()
    labels[0, 0] = -100
    loss_fn = causal_lm_loss_fn(None)
    ref = loss_fn(native(ids), labels, VOCAB)
    loss = loss_fn(model(ids), labels, VOCAB)
    assert_rel_close(loss, ref, RTOL, f"tied(gather={gather}) loss")
    ref.backward()
    loss.backward()
    assert_rel_close(
        _gathered_grad(model.embed.weight), native.embed.weight.grad, RTOL, "tied weight grad"
    )


def _check_cross_entropy(tp: int, rank: int) -> None:
    padded = 128 if tp == 2 else 256
    full = torch.randn(4, 9, VOCAB) * 3
    labels = torch.randint(0, VOCAB, (4, 9))
    labels[0] = -100
    labels[2, 3] = VOCAB - 1
    full_ref = full.clone().requires_grad_()
    ref = F.cross_entropy(full_ref.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
    ref.backward()
    local = _local_cols(full, padded).clone()
    per = padded // tp
    cols = torch.arange(rank * per, (rank + 1) * per)
    local[..., cols >= VOCAB] = 50.0  # large padding logits: included, they would dominate
    local.requires_grad_()
    with CommTracker() as fwd:
        loss = cross_entropy_1d(local, labels, None, ignore_index=-100, vocab_size=VOCAB)
    assert fwd.calls() == fwd.calls("all_reduce") == 2, fwd.table()
    assert_rel_close(loss, ref, RTOL, "cross_entropy_1d loss")
    with CommTracker() as bwd:
        loss.backward()
    assert bwd.calls() == 0, "the vocab-parallel CE backward is local"
    assert_rel_close(local.grad, _local_cols(full_ref.grad, padded), RTOL, "cross_entropy_1d grad")
    assert float(local.grad[..., cols >= VOCAB].abs().sum()) == 0.0

    # The causal loss_fn on local logits equals it on full logits (which the single-process
    # test checks against transformers' ForCausalLMLoss): shift once, num_items_in_batch,
    # shift_labels.
    loss_fn = causal_lm_loss_fn(None)
    for kwargs in _LOSS_CASES(labels):
        ref_logits = full.clone().requires_grad_()
        expected = loss_fn(ref_logits, labels, VOCAB, **kwargs)
        expected.backward()
        x = _local_cols(full, padded).clone().requires_grad_()
        got = loss_fn(x, labels, VOCAB, **kwargs)
        name = f"loss_fn(local, {sorted(kwargs)})"
        assert_rel_close(got, expected, RTOL, name)
        got.backward()
        assert_rel_close(x.grad, _local_cols(ref_logits.grad, padded), RTOL, f"{name} grad")


def _LOSS_CASES(labels: torch.Tensor) -> list[dict]:  # noqa: N802 - a table
    return [{}, {"num_items_in_batch": torch.tensor(17)}, {"shift_labels": labels.roll(1, 1)}]


def _check_dropout(tp: int) -> None:
    replicated = DropoutForReplicatedInput.from_native_module(nn.Dropout(0.5), None)
    parallel = DropoutForParallelInput.from_native_module(nn.Dropout(0.5), None)
    torch.manual_seed(1234 + dist.get_rank())  # the global RNG differs between ranks
    x = torch.ones(4, 64)
    masks = {}
    for name, layer in (("replicated", replicated), ("parallel", parallel)):
        a, b = layer(x), layer(x)
        assert not torch.equal(a, b), f"{name}: successive calls draw new masks"
        assert 0.3 < float((a == 0).float().mean()) < 0.7
        assert_rel_close(a.mean(), torch.tensor(1.0), 0.25, f"{name} keeps the expectation")
        masks[name] = all_gather_object(a, None)
    assert all(torch.equal(m, masks["replicated"][0]) for m in masks["replicated"]), (
        "replicated regions draw the same mask on every rank"
    )
    par = masks["parallel"]
    assert all(not torch.equal(par[i], par[j]) for i in range(tp) for j in range(i)), (
        "split regions draw a different mask on every rank"
    )
    replicated.eval()
    assert torch.equal(replicated(x), x)


@distributed_test(2, 4)
def test_vocab_parallel_layers_match_native(rank: int, world_size: int) -> None:
    """Catches: ids of other shards not masked, padding rows/columns leaking into outputs or
    the loss, a lost tie, a missing backward all-reduce of the LM head input, a CE over the
    wrong count, a double label shift, and dropout masks that disagree (or agree) across ranks.
    """
    torch.manual_seed(0)
    for divisible_by in (64, 8):
        _check_embedding(divisible_by)
    for gather in (True, False):
        _check_lm_head(gather, bias=not gather)
        _check_tied(gather)
    _check_cross_entropy(world_size, rank)
    _check_dropout(world_size)
    with pytest.raises(ValueError, match="make_vocab_size_divisible_by"):
        VocabParallelEmbedding1D.from_native_module(nn.Embedding(10, 4), None, 0)
    with pytest.raises(ValueError, match="vocab_size=500"):
        cross_entropy_1d(torch.randn(2, 64), torch.zeros(2, dtype=torch.long), None, -100, 500)


def test_vocab_layers_single_rank_and_meta() -> None:
    """Catches: a loss_fn that shifts labels twice or divides by the wrong count (against
    transformers' ForCausalLMLoss), padding visible at TP 1, meta natives built eagerly."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    torch.manual_seed(0)
    full = torch.randn(3, 6, VOCAB)
    labels = torch.randint(0, VOCAB, (3, 6))
    labels[0, 2:] = -100
    loss_fn = causal_lm_loss_fn(None)
    for kwargs in _LOSS_CASES(labels):
        expected = ForCausalLMLoss(full, labels, VOCAB, **kwargs)
        for logits in (full, F.pad(full, (0, 28), value=30.0)):  # padded at TP 1
            got = loss_fn(logits, labels, VOCAB, **kwargs)
            assert_rel_close(got, expected, RTOL, f"loss_fn vs ForCausalLMLoss {sorted(kwargs)}")
    native = nn.Linear(D, VOCAB)
    head = VocabParallelLMHead1D.from_native_module(copy.deepcopy(native), None)
    x = torch.randn(3, D)
    labels = torch.tensor([1, -100, 99])
    loss = causal_lm_loss_fn(None)(head(x), labels, VOCAB, shift_labels=labels)
    assert_rel_close(loss, F.cross_entropy(native(x), labels), RTOL, "tp=1 loss")
    with torch.device("meta"):
        emb = nn.Embedding(VOCAB, D)
    layer = VocabParallelEmbedding1D.from_native_module(emb, None)
    assert layer.weight.is_meta and tuple(layer.weight.shape) == (128, D)
