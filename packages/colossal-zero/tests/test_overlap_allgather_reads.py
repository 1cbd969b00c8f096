"""With ``overlap_allgather`` (the default) no read of a parameter sees stale values.

The step returns with the all-gathers in flight. Each test reads parameters in a way the
module forward pre-hook alone does not cover and compares with the single-process reference;
without :class:`~colossal.zero.param_gather.PendingReadMode` the reads return the values of
the previous step on the slices other ranks own.
"""

from __future__ import annotations

import os

import torch
from torch.nn import functional
from torch.overrides import TorchFunctionMode
from zero_testlib import batch, local, loss_fn, make_model, make_optimizer, reference

from colossal.core.testing import distributed_test, relative_error
from colossal.zero import LowLevelZeroOptimizer

STEPS = 3


def _gloo_only() -> None:
    """Overlap needs gloo: through shared memory the all-gathers are synchronous."""
    os.environ["COLOSSAL_SHM_COMM"] = "0"


def _train(rank: int, world_size: int, stage: int, steps: int = STEPS):
    _gloo_only()
    model = make_model()
    opt = LowLevelZeroOptimizer(
        make_optimizer(model, kind="sgd"), partition_grad=stage == 2, reduce_bucket_size=40
    )
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        opt.backward(loss_fn(model, local(x, rank, world_size), local(y, rank, world_size)))
        opt.step()
    return model, opt


def _slow_gathers(opt: LowLevelZeroOptimizer) -> None:
    """Make every outstanding all-gather land late, as a busy network would."""
    for order, work in list(opt.gatherer._pending.items()):
        if work is not None:
            work.wait()
        opt.gatherer._pending[order] = _Late(opt, order)


class _Late:
    """A finished all-gather whose result is only written when waited for."""

    def __init__(self, opt: LowLevelZeroOptimizer, order: int) -> None:
        bucket = next(b for b in opt.buckets if b.order == order)
        flat = opt.flat_params[bucket.group]
        self.region = flat[bucket.start : bucket.start + bucket.size]
        self.fresh = self.region.clone()
        self.region.zero_()  # what a read before the wait would see: not the new values

    def wait(self) -> None:
        self.region.copy_(self.fresh)


@distributed_test(2, 4)
def test_reads_between_step_and_forward_are_fresh(rank: int, world_size: int) -> None:
    for stage in (1, 2):
        model, opt = _train(rank, world_size, stage)
        assert opt.gatherer.pending, "the step should return with its all-gathers in flight"
        _slow_gathers(opt)
        values = [p.detach().clone() for p in model.parameters()]  # no wait_params()
        _, ref = reference(STEPS, kind="sgd")
        for v, q in zip(values, ref.parameters(), strict=True):
            assert relative_error(v, q) <= 1e-5
        assert torch._C._len_torch_function_stack() == 0, "the guard left the mode behind"


class _RootReads(torch.nn.Module):
    """Reads its child's weight in its own forward (a tied head written by hand)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Read before any of net's own hooks run.
        side = functional.linear(x, self.net.embed.weight).sum(-1, keepdim=True)
        return self.net(x) + side


@distributed_test(2)
def test_parent_forward_reading_a_child_weight(rank: int, world_size: int) -> None:
    def run(model: torch.nn.Module, opt, r: int, w: int) -> list[float]:
        losses = []
        for step in range(STEPS):
            x, y = batch(step)
            loss = (model(local(x, r, w)) - local(y, r, w)).pow(2).mean()
            opt.zero_grad()
            (opt.backward(loss) if w > 1 else loss.backward())
            opt.step()
            if w > 1:
                _slow_gathers(opt)
            losses.append(loss.item())
        return losses

    _gloo_only()
    model = _RootReads()
    opt = LowLevelZeroOptimizer(make_optimizer(model, kind="sgd"), reduce_bucket_size=40)
    run(model, opt, rank, world_size)
    ref = _RootReads()
    run(ref, make_optimizer(ref, kind="sgd"), 0, 1)
    opt.wait_params()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert relative_error(p, q) <= 1e-5


@distributed_test(2)
def test_load_state_dict_after_step_is_not_overwritten(rank: int, world_size: int) -> None:
    model, opt = _train(rank, world_size, stage=1)
    _slow_gathers(opt)
    target = {k: torch.full_like(v, 0.25) for k, v in model.state_dict().items()}
    model.load_state_dict(target)
    opt.wait_params()
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), target[name]), f"{name} lost the loaded values"


class _Passthrough(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        return func(*args, **(kwargs or {}))


@distributed_test(2)
def test_step_under_another_mode_waits(rank: int, world_size: int) -> None:
    _gloo_only()
    model = make_model()
    opt = LowLevelZeroOptimizer(make_optimizer(model, kind="sgd"), reduce_bucket_size=40)
    x, y = batch(0)
    opt.backward(loss_fn(model, local(x, rank, world_size), local(y, rank, world_size)))
    with _Passthrough():
        opt.step()
        assert not opt.gatherer.pending, "overlapping under a foreign mode would break its stack"
    assert torch._C._len_torch_function_stack() == 0
    _, ref = reference(1, kind="sgd")
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert relative_error(p, q) <= 1e-5


@distributed_test(2)
def test_mode_leaves_after_the_forward(rank: int, world_size: int) -> None:
    model, opt = _train(rank, world_size, stage=2)
    assert torch._C._len_torch_function_stack() == 1
    x, _ = batch(0)
    model(local(x, rank, world_size))
    assert not opt.gatherer.pending
    assert torch._C._len_torch_function_stack() == 0, "the mode stayed on after the forward"
