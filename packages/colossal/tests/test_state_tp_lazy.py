"""Lazy init with tensor parallelism: each rank materializes only its part, equal to eager.

A model built under :class:`LazyInitContext` is sharded (its parameters replaced with
``shard_parameter`` parts of the lazy ones, as the parallel layers do) and then materialized.
Materializing needs no communication, so every rank of a TP group is checked in one process.
"""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
from test_state_tp_checkpoint import FAMILIES, build, shard_by_hand
from torch import nn

import colossal.lazy.context as lazy_context
from colossal.core import shard_source, shard_spec
from colossal.lazy import LazyInitContext


def _lazy(family: str, seed: int = 0) -> nn.Module:
    with LazyInitContext():
        return build(family, seed)


def _materialize_tracking(
    model: nn.Module, sources: set[int], monkeypatch: Any
) -> list[weakref.ref[torch.Tensor]]:
    """Materialize ``model``; weak references to the wholes built for shard sources."""
    alive: list[weakref.ref[torch.Tensor]] = []
    real_materialize = lazy_context.materialize_tensor

    def tracked(tensor: torch.Tensor) -> torch.Tensor:
        # One whole tensor at a time: every earlier whole of a shard source is freed.
        assert all(ref() is None for ref in alive), "a whole tensor outlived its part"
        full = real_materialize(tensor)
        if id(tensor) in sources:
            alive.append(weakref.ref(full))
        return full

    monkeypatch.setattr(lazy_context, "materialize_tensor", tracked)
    LazyInitContext.materialize(model)
    monkeypatch.undo()
    return alive


@pytest.mark.parametrize("family", FAMILIES)
def test_lazy_tp_materializes_only_the_part_equal_to_eager(family: str, monkeypatch: Any) -> None:
    """Catches: the whole tensor kept (local shape wrong), the part taken from the wrong rows
    (or q/k/v blocks), padding not zero, marks lost, ties broken, fulls kept alive."""
    tp = 4
    for rank in range(tp):
        eager = shard_by_hand(build(family), rank, tp)
        lazy = shard_by_hand(_lazy(family), rank, tp)
        sources = {id(shard_source(p)) for p in lazy.parameters() if shard_source(p) is not None}
        assert sources and all(p.is_meta for p in lazy.parameters())

        alive = _materialize_tracking(lazy, sources, monkeypatch)
        assert len(alive) == len(sources) and all(ref() is None for ref in alive)

        eager_params = dict(eager.named_parameters(remove_duplicate=False))
        for name, p in lazy.named_parameters(remove_duplicate=False):
            ref = eager_params[name]
            assert not p.is_meta and p.shape == ref.shape, f"rank {rank}: {name} shape"
            assert torch.equal(p, ref), f"rank {rank}: {name} values"
            assert isinstance(p, nn.Parameter) and p.requires_grad == ref.requires_grad
            spec, ref_spec = shard_spec(p), shard_spec(ref)
            assert (spec is None) == (ref_spec is None), f"rank {rank}: {name} mark"
            if spec is not None:
                assert (spec.part, spec.shape) == (ref_spec.part, ref_spec.shape)
                assert shard_source(p) is None  # the meta whole is not kept
        emb = lazy.get_input_embeddings().weight
        assert lazy.get_output_embeddings().weight is emb  # still tied


def test_lazy_tp_inside_the_context_still_materializes_the_part() -> None:
    """Sharding inside the context (the local meta parameter is itself lazy) keeps the part,
    not the lazy ``torch.empty`` the local parameter was made with."""
    torch.manual_seed(0)
    eager = shard_by_hand(build("gpt2"), 1, 2)
    with LazyInitContext():
        lazy = shard_by_hand(build("gpt2"), 1, 2)
    LazyInitContext.materialize(lazy)
    for (name, a), b in zip(eager.state_dict().items(), lazy.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
