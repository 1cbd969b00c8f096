"""The wrapper interfaces behave like the plain optimizer and module they wrap."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from colossal.core import ModelWrapper, OptimizerWrapper


def _model_and_batch() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), torch.randn(5, 4)


def test_optimizer_wrapper_matches_plain_optimizer() -> None:
    model, x = _model_and_batch()
    ref = copy.deepcopy(model)
    opt = OptimizerWrapper(torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        opt.backward(model(x).pow(2).sum())
        norm = opt.get_grad_norm()
        ref_opt.zero_grad()
        ref(x).pow(2).sum().backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf"))
        assert norm == pytest.approx(float(ref_norm), rel=1e-6)
        clipped_from = opt.clip_grad_by_norm(0.5)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        assert clipped_from == pytest.approx(float(ref_norm), rel=1e-6)
        opt.step()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)
    assert opt.unwrap() is opt.optim and opt.param_groups[0]["lr"] == 0.1


def test_backward_by_grad_equals_backward() -> None:
    model, x = _model_and_batch()
    opt = OptimizerWrapper(torch.optim.SGD(model.parameters(), lr=0.1))
    out = model(x)
    grad = torch.ones_like(out) * 2
    opt.backward_by_grad(out, grad)
    got = [p.grad.clone() for p in model.parameters()]
    opt.zero_grad()
    (model(x) * 2).sum().backward()
    for g, p in zip(got, model.parameters(), strict=True):
        assert torch.allclose(g, p.grad)


def test_state_dict_roundtrip_and_errors() -> None:
    model, x = _model_and_batch()
    opt = OptimizerWrapper(torch.optim.Adam(model.parameters(), lr=1e-2))
    opt.backward(model(x).sum())
    opt.step()
    state = opt.state_dict()
    other = OptimizerWrapper(torch.optim.Adam(model.parameters(), lr=1e-2))
    other.load_state_dict(state)
    assert torch.equal(other.state_dict()["state"][0]["exp_avg"], state["state"][0]["exp_avg"])
    with pytest.raises(TypeError, match="needs a torch.optim.Optimizer, got Linear"):
        OptimizerWrapper(nn.Linear(1, 1))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_norm must be > 0"):
        opt.clip_grad_by_norm(0)


def test_model_wrapper_unwraps_nested() -> None:
    model, x = _model_and_batch()
    wrapped = ModelWrapper(ModelWrapper(model))
    assert wrapped.unwrap() is model
    assert torch.equal(wrapped(x), model(x))
