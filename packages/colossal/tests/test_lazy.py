"""LazyInitContext: no memory inside, weights equal eager init, plugins keep only their part."""

from __future__ import annotations

import pytest
import torch
from booster_testlib import full_state, make_booster, make_optimizer, tiny_gpt2_config
from torch import nn

from colossal.core.testing import distributed_test
from colossal.lazy import LazyInitContext, is_lazy, lazy_to, materialize_tensor


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


# ---- ColossalAI's .to() / .cuda() / .cpu() / .half() on a lazy model before boost --------------


def test_module_moves_and_casts_are_recorded_then_replayed() -> None:
    """``model.to/cpu/half/float/to(dtype)`` on a lazy model stays lazy and replays on
    materialize (ColossalAI's LazyTensor records moves).

    Catches: "Cannot copy out of meta tensor" from ``Module.to``; a cast dropped or applied
    twice at materialize (half then double must round the weights like eager); a parameter
    whose recipe is replaced reading itself (infinite recursion); new parameter objects
    (the optimizer built before would hold stale ones); lazy tensors made real (memory).
    """
    eager = _eager()
    lazy = _lazy()
    before = {n: p for n, p in lazy.named_parameters()}
    assert lazy.to("cpu") is lazy
    lazy.cpu().half().to(torch.float64).float()
    assert all(is_lazy(p) and p.dtype == torch.float32 for p in lazy.parameters())
    assert all(p is before[n] for n, p in lazy.named_parameters())
    LazyInitContext.materialize(lazy)
    rounded = {n: t.half().float() for n, t in eager.state_dict().items()}
    for name, value in lazy.state_dict().items():
        assert torch.equal(value, rounded[name]), name
    assert not torch.equal(lazy.net[0].weight, eager.net[0].weight)  # the half() was kept
    nn.Linear(2, 2).to(torch.float64)  # models without lazy tensors: the usual path


def test_cuda_is_recorded_and_tied_weights_stay_tied() -> None:
    """``model.cuda()`` on a lazy GPT-2 returns at once (recorded); the tie survives a cast.

    Catches: ``.cuda()`` failing before boost; the tied ``lm_head``/``wte`` split in two by
    the conversion; the recorded device lost (materialized on the CPU after ``.cuda()``).
    """
    transformers = pytest.importorskip("transformers")

    def build() -> nn.Module:
        with LazyInitContext():
            return transformers.GPT2LMHeadModel(tiny_gpt2_config())

    lazy = build()
    assert lazy.cuda() is lazy
    assert all(is_lazy(p) for p in lazy.parameters())
    if torch.cuda.is_available():
        LazyInitContext.materialize(lazy)
        assert lazy.transformer.wte.weight.device.type == "cuda"
    else:  # torch's own error when the recorded move runs: the move was kept
        with pytest.raises((AssertionError, RuntimeError), match="CUDA|cuda"):
            LazyInitContext.materialize(lazy)
    lazy = build().to(torch.float64)
    LazyInitContext.materialize(lazy)
    assert lazy.lm_head.weight is lazy.transformer.wte.weight
    assert lazy.transformer.wte.weight.dtype == torch.float64


def test_lazy_to_and_materialize_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    """Catches: ``lazy_to`` materializing early or losing the values; ColossalAI's
    ``materialize(model, verbose=True)`` refused; ``device=`` ignored."""
    torch.manual_seed(1)
    expected = torch.randn(3, 4)
    torch.manual_seed(1)
    with LazyInitContext():
        lazy = torch.randn(3, 4)
    cast = lazy_to(lazy, torch.bfloat16)
    assert is_lazy(cast) and cast.dtype == torch.bfloat16
    assert torch.equal(materialize_tensor(cast), expected.bfloat16())
    assert torch.equal(lazy_to(expected, torch.float64), expected.double())
    model = _lazy()
    model.net[4] = nn.Linear(16, 3)  # 51 real numbers among 11 parameters
    LazyInitContext.materialize(model, device=torch.device("meta"), verbose=True)
    assert all(not is_lazy(p) for p in model.parameters())
    assert model.net[0].weight.is_meta  # device= was honoured
    out = capsys.readouterr().out
    assert "Param lazy rate: 9/11" in out and "Non-lazy numel: 51 " in out, out
