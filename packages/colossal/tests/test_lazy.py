"""LazyInitContext: no memory inside, weights equal eager init, plugins keep only their part."""

from __future__ import annotations

import pytest
import torch
from booster_testlib import full_state, make_booster, make_optimizer, tiny_gpt2_config
from torch import nn

from colossal.core.testing import distributed_test
from colossal.lazy import LazyInitContext, is_lazy


def _build() -> nn.Module:
    return nn.Sequential(
        nn.Linear(6, 16),
        nn.Embedding(10, 6, padding_idx=1),
        nn.LayerNorm(16),
        nn.ModuleList([nn.Linear(16, 16) for _ in range(2)]),
        nn.Linear(16, 3),
    )


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = _build()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.net[2](self.net[0](x))
        for layer in self.net[3]:
            h = torch.tanh(layer(h))
        return self.net[4](h)


def _eager(seed: int = 3) -> Model:
    torch.manual_seed(seed)
    return Model()


def _lazy(seed: int = 3) -> Model:
    torch.manual_seed(seed)
    with LazyInitContext():
        return Model()


def test_lazy_equals_eager_and_allocates_nothing() -> None:
    eager = _eager()
    after_eager = torch.rand(3)
    lazy = _lazy()
    after_lazy = torch.rand(3)
    assert torch.equal(after_eager, after_lazy)  # the random stream continues identically
    assert all(p.is_meta and is_lazy(p) for p in lazy.parameters())
    LazyInitContext.materialize(lazy)
    for (name, a), (_, b) in zip(
        eager.state_dict().items(), lazy.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    assert lazy.net[1].weight[1].abs().sum() == 0  # padding row zeroed through a view


def test_lazy_gpt2_equals_eager() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = tiny_gpt2_config()
    torch.manual_seed(0)
    eager = transformers.GPT2LMHeadModel(cfg)
    torch.manual_seed(0)
    with LazyInitContext():
        lazy = transformers.GPT2LMHeadModel(cfg)
    LazyInitContext.materialize(lazy)
    assert lazy.lm_head.weight is lazy.transformer.wte.weight
    for (name, a), (_, b) in zip(
        eager.state_dict().items(), lazy.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


@distributed_test(2)
def test_plugins_materialize_lazy_models(rank: int, world_size: int) -> None:
    """Lazy tensors are materialized; real ones mixed in (a module built eagerly, a buffer
    registered later) keep their values."""
    eager = _eager()
    eager.register_buffer("real", torch.arange(5.0))
    eager_state = eager.state_dict()
    for plugin in ("ddp", "zero2", "fsdp"):
        booster = make_booster(plugin)
        model = _lazy()
        model.net[4] = _eager().net[4]  # a real module in a lazy model
        model.register_buffer("real", torch.arange(5.0))
        optimizer = make_optimizer(model)
        model, optimizer, *_ = booster.boost(model, optimizer)
        if plugin == "fsdp":  # each rank holds only its rows of every weight
            local = sum(p.to_local().numel() for p in model.parameters())
            assert local < sum(p.numel() for p in model.parameters())
        state = full_state(model, booster)
        for name, ref in eager_state.items():
            assert torch.equal(state[name].cpu(), ref), f"{plugin}: {name}"
        # and the optimizer trains the real parameters
        x = torch.randn(4, 6)
        loss = model(x).pow(2).mean()
        booster.backward(loss, optimizer)
        optimizer.step()
        after = full_state(model, booster)
        assert not torch.equal(after["net.0.weight"].cpu(), eager_state["net.0.weight"]), plugin
