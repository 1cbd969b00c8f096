"""An fp16 overflow on one rank skips the step everywhere and backs the loss scale off."""

from __future__ import annotations

import pytest
import torch
from zero_testlib import batch, local, loss_fn, make_model, make_optimizer

from colossal.core.testing import distributed_test
from colossal.zero import LowLevelZeroOptimizer


@pytest.mark.parametrize("stage", [1, 2])
@distributed_test(1, 2, 4)
def test_overflow_skips_step_on_every_rank(rank: int, world_size: int, stage: int) -> None:
    model = make_model(torch.float16)
    opt = LowLevelZeroOptimizer(
        make_optimizer(model),
        partition_grad=stage == 2,
        reduce_bucket_size=64,
        initial_scale=2**10,
        hysteresis=1,
        backoff_factor=0.5,
    )
    x, y = batch(0)
    x, y = local(x, rank, world_size), local(y, rank, world_size)
    before = [p.detach().clone() for p in model.parameters()]
    bad_rank = world_size - 1
    loss = loss_fn(model, x, y)
    if rank == bad_rank:
        loss = loss * float("inf")  # every gradient of this rank becomes inf/nan
    opt.backward(loss)
    opt.step()
    assert opt.loss_scale == 2**9, "the scale did not back off"
    for p, q in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, q), "a parameter changed although the step overflowed"
    assert opt.optim.state == {} or all(not s for s in opt.optim.state.values())
    # The next, clean step goes through and keeps the reduced scale.
    opt.zero_grad()
    opt.backward(loss_fn(model, x, y))
    opt.step()
    assert opt.loss_scale == 2**9
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert opt.state_dict()["loss_scaler"]["scale"] == 2**9
