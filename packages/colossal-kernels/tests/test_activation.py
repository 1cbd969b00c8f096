"""Fused tanh-GELU: the same function and gradient as the composed modules it replaces."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

from colossal.kernels import FusedGELUTanh, gelu_tanh, replace_activations


class NewGELUActivation(nn.Module):  # transformers' gelu_new, the same formula
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


class FastGELUActivation(nn.Module):  # transformers' gelu_fast: the same function, refactored
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


class Mlp(nn.Module):
    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.fc, self.act, self.out = nn.Linear(16, 64), act, nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.fc(x)))


def test_gelu_tanh_equals_the_composed_formula_and_its_gradient() -> None:
    """Catches the exact (erf) GELU, whose values differ by up to ~4.7e-4: 40x the tolerance."""
    x = torch.linspace(-6, 6, 20001, dtype=torch.float64).requires_grad_()
    expected = NewGELUActivation()(x)
    (grad_expected,) = torch.autograd.grad(expected.sum(), x)
    y = x.detach().float().requires_grad_()
    got = gelu_tanh(y)
    (grad,) = torch.autograd.grad(got.sum(), y)
    torch.testing.assert_close(got.double(), expected.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(grad.double(), grad_expected, rtol=0, atol=1e-5)
    assert (F.gelu(y.detach()).double() - expected.detach()).abs().max() > 4e-4


def test_replace_activations_swaps_only_tanh_gelus_and_keeps_training_equal() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Mlp(NewGELUActivation()), Mlp(FastGELUActivation()), Mlp(nn.GELU()))
    reference = nn.Sequential(*[Mlp(m.act) for m in model])
    reference.load_state_dict(model.state_dict())
    model.eval()
    assert replace_activations(model) == 2
    assert [type(m.act) for m in model] == [FusedGELUTanh, FusedGELUTanh, nn.GELU]
    assert not model[0].act.training  # the mode carries over
    assert replace_activations(model) == 0  # idempotent
    x = torch.randn(8, 16)
    for net in (model, reference):
        net(x).square().sum().backward()
    torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_replace_activations_on_gpt2_gives_the_same_logits() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=2,
                                     n_head=2, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 50, (2, 16))
    before = model(input_ids=ids).logits
    assert replace_activations(model) == 2  # one per block
    torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=1e-5, atol=1e-5)
