"""The fused Adam kernel runs ZeRO's step when the user left the choice open, and only then."""

from __future__ import annotations

import pytest
import torch
from zero_testlib import batch, loss_fn, make_model

from colossal.core.testing import distributed_test
from colossal.zero import LowLevelZeroOptimizer
from colossal.zero.fused_step import fused_when_unset


def _fused_during_step(optimizer: torch.optim.Optimizer) -> list[object]:
    """Step ``optimizer`` under the helper; return each group's ``fused`` as the step saw it."""
    seen: list[object] = []
    handle = optimizer.register_step_pre_hook(
        lambda opt, *_: seen.extend(g["fused"] for g in opt.param_groups)
    )
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = torch.ones_like(p)
    with fused_when_unset(optimizer):
        optimizer.step()
    handle.remove()
    return seen


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_unset_groups_step_fused_and_are_restored(cls: type[torch.optim.Optimizer]) -> None:
    a, b = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))
    opt = cls([{"params": [a]}, {"params": [b], "fused": False}], lr=0.1)
    assert _fused_during_step(opt) == [True, False]
    assert [g["fused"] for g in opt.param_groups] == [None, False]
    assert [g["fused"] for g in opt.state_dict()["param_groups"]] == [None, False]


def test_foreach_and_other_optimizers_are_left_alone() -> None:
    p = torch.nn.Parameter(torch.zeros(4))
    assert _fused_during_step(torch.optim.AdamW([p], foreach=True)) == [None]
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(4))], lr=0.1)
    assert _fused_during_step(sgd) == [None]


def test_restored_when_the_step_raises() -> None:
    p = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.AdamW([p])
    with pytest.raises(RuntimeError, match="boom"), fused_when_unset(opt):
        assert opt.param_groups[0]["fused"] is True
        raise RuntimeError("boom")
    assert opt.param_groups[0]["fused"] is None


def test_fused_update_equals_the_loop() -> None:
    """Same AdamW update to rounding (a wrong kernel or lost state would differ by ~lr)."""
    torch.manual_seed(0)
    init, grads = torch.randn(1000), [torch.randn(1000) for _ in range(3)]
    results = []
    for use_helper in (False, True):
        p = torch.nn.Parameter(init.clone())
        opt = torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1)
        for g in grads:
            p.grad = g.clone()
            if use_helper:
                with fused_when_unset(opt):
                    opt.step()
            else:
                opt.step()
        results.append(p.detach().clone())
    assert (results[0] - init).abs().max() > 1e-2  # the steps move the weights
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=1e-6)


@distributed_test(2)
def test_zero_state_dict_keeps_the_users_choice(rank: int, world_size: int) -> None:
    """A ZeRO step runs fused, yet its state dict (and so checkpoints) keep ``fused=None``."""
    model = make_model()
    opt = LowLevelZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    seen: list[object] = []
    opt.optim.register_step_pre_hook(lambda o, *_: seen.append(o.param_groups[0]["fused"]))
    x, y = batch(0)
    opt.backward(loss_fn(model, x, y))
    opt.step()
    assert seen == [True]
    assert opt.state_dict()["param_groups"][0]["fused"] is None
