"""LowLevelZeroOptimizer's ColossalAI helpers and extra_dp_group, at world 2 against one process.

ColossalAI's ZeRO tests compare ``get_param_grad(p)`` with a plain model's ``p.grad`` and walk
``working_to_master_param`` / ``master_to_working_param``; ColossalAI's plugin passes an
``extra_dp_group`` to shard over two data-parallel axes.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from colossal.core.testing import distributed_test
from colossal.zero import LowLevelZeroOptimizer


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)


def _reference() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Full-batch gradients and the weights after one SGD step, in one process."""
    model = _model()
    x, y = _data()
    nn.functional.mse_loss(model(x), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return grads, [p.detach().clone() for p in model.parameters()]


def _step(
    rank: int, world: int, stage: int, **kwargs: object
) -> tuple[nn.Module, LowLevelZeroOptimizer]:
    model = _model()
    zero = LowLevelZeroOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        partition_grad=stage == 2,
        reduce_bucket_size=40,  # several buckets, parameters straddling rank slices
        **kwargs,  # type: ignore[arg-type]
    )
    x, y = _data()
    n = x.shape[0] // world
    loss = nn.functional.mse_loss(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n])
    zero.backward(loss)
    return model, zero


@distributed_test(2)
def test_param_grad_maps_and_extra_dp(rank: int, world_size: int) -> None:
    """Stages 1 and 2, then extra_dp_group, in one pair of processes (one spawn).

    Catches: every bug named in ``_check_maps`` and ``_check_extra_dp``.
    """
    torch.set_num_threads(1)
    for stage in (1, 2):
        _check_maps(rank, world_size, stage)
    _check_extra_dp(rank, world_size)


def _check_maps(rank: int, world_size: int, stage: int) -> None:
    """get_param_grad equals the plain model's grad; the maps are this rank's master elements.

    Catches: a gradient still scaled by the group size or missing the other rank's half,
    another parameter's elements (wrong bucket offset), the maps pointing at copies (a step
    would not show in them) or not inverse of each other, padding that does not add up to
    the bucket, a grad reported after the step consumed it.
    """
    grads, stepped = _reference()
    model, zero = _step(rank, world_size, stage)
    for p, want in zip(model.parameters(), grads, strict=True):
        got = zero.get_param_grad(p)
        assert got is not None and got.shape == p.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for p in model.parameters():
        master = zero.working_to_master_param[id(p)]
        assert zero.master_to_working_param[id(master)] is p
    for bucket in zero.buckets:
        pads = sum(zero.get_param_padding_size(s.param) for s in bucket.slots)
        assert bucket.used + pads == bucket.size
    zero.step()
    zero._force_wait_all_gather()
    total = torch.zeros(())
    for p, want in zip(model.parameters(), stepped, strict=True):
        torch.testing.assert_close(p.detach(), want, rtol=1e-5, atol=1e-6)
        master = zero.working_to_master_param[id(p)]
        start = _start(zero, p)
        torch.testing.assert_close(master, p.detach().reshape(-1)[start : start + master.numel()])
        total += master.numel()
    counts = torch.tensor([float(total)])
    dist.all_reduce(counts)
    assert int(counts) == sum(p.numel() for p in model.parameters())  # each element once
    assert zero.get_param_grad(next(model.parameters())) is None
    with pytest.raises(ValueError, match="not trained by this"):
        zero.get_param_grad(torch.nn.Parameter(torch.ones(2)))


def _start(zero: LowLevelZeroOptimizer, p: torch.Tensor) -> int:
    for bucket in zero.buckets:
        for slot in bucket.slots:
            if slot.param is p:
                return bucket.slot_shard_range(slot, zero.rank, zero.world_size)[0]
    raise AssertionError("parameter not found")


def _check_extra_dp(rank: int, world_size: int) -> None:
    """dp = each rank alone, extra_dp = the job: ZeRO over both ranks, one step as DDP's.

    Catches: extra_dp_group ignored (ZeRO over one rank: the gradients are not averaged and
    the weights differ from the reference), groups that are not two axes accepted.
    """
    singles = [dist.new_group([r]) for r in range(world_size)]
    _, stepped = _reference()
    model, zero = _step(
        rank, world_size, 2, dp_process_group=singles[rank], extra_dp_group=dist.group.WORLD
    )
    assert zero.world_size == world_size
    zero.step()
    zero.wait_params()
    for p, want in zip(model.parameters(), stepped, strict=True):
        torch.testing.assert_close(p.detach(), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="not two axes of one grid"):
        LowLevelZeroOptimizer(
            torch.optim.SGD(_model().parameters(), lr=0.1), extra_dp_group=dist.group.WORLD
        )
