"""Frozen and unused parameters, communication volume, memory report and bad input."""

from __future__ import annotations

import pytest
import torch
from zero_testlib import batch, local, loss_fn, make_model, make_optimizer, reference

from colossal.core.comm import CommTracker, shm
from colossal.core.testing import distributed_test, relative_error
from colossal.zero import LowLevelZeroOptimizer


@pytest.mark.parametrize("stage", [1, 2])
@distributed_test(2, 4)
def test_frozen_layer_and_branch_unused_on_one_rank(rank: int, world_size: int, stage: int) -> None:
    model = make_model(frozen=True)
    frozen_before = model.body[1].weight.detach().clone()
    opt = LowLevelZeroOptimizer(
        make_optimizer(model, kind="sgd"), partition_grad=stage == 2, reduce_bucket_size=30
    )
    ref_model = make_model(frozen=True)
    ref_opt = make_optimizer(ref_model, kind="sgd")
    for step in range(3):
        x, y = batch(step)
        opt.zero_grad()
        # Rank 0 skips the branch: its parameters get no gradient there.
        use = rank != 0
        opt.backward(
            loss_fn(model, local(x, rank, world_size), local(y, rank, world_size), use_branch=use)
        )
        opt.step()
        # Reference: the mean of every rank's local loss, each with its own branch choice.
        ref_opt.zero_grad()
        total = (
            sum(
                loss_fn(
                    ref_model, local(x, r, world_size), local(y, r, world_size), use_branch=r != 0
                )
                for r in range(world_size)
            )
            / world_size
        )
        total.backward()
        ref_opt.step()
    assert torch.equal(model.body[1].weight, frozen_before)
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        assert relative_error(p, q) <= 1e-5, name


@distributed_test(2)
def test_rank_without_backward_still_steps(rank: int, world_size: int) -> None:
    model = make_model()
    opt = LowLevelZeroOptimizer(
        make_optimizer(model, kind="sgd"), partition_grad=True, reduce_bucket_size=30
    )
    x, y = batch(0)
    if rank == 0:  # rank 1 has no data this step and only calls step()
        opt.backward(loss_fn(model, local(x, 0, 2), local(y, 0, 2)))
    opt.step()
    ref = make_model()
    ref_opt = make_optimizer(ref, kind="sgd")
    (loss_fn(ref, local(x, 0, 2), local(y, 0, 2)) / 2).backward()
    ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert relative_error(p, q) <= 1e-5


@pytest.mark.parametrize("stage", [1, 2])
@distributed_test(2, 4)
def test_communication_volume_per_step(rank: int, world_size: int, stage: int) -> None:
    model = make_model(torch.bfloat16)
    opt = LowLevelZeroOptimizer(
        make_optimizer(model), partition_grad=stage == 2, reduce_bucket_size=40
    )
    padded = sum(b.size for b in opt.buckets)
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params <= padded < n_params + len(opt.buckets) * world_size
    steps = 2
    with CommTracker() as tracker:
        for step in range(steps):
            x, y = batch(step)
            opt.zero_grad()
            opt.backward(loss_fn(model, local(x, rank, world_size), local(y, rank, world_size)))
            opt.step()
    param_bytes = padded * 2  # bf16
    nb = len(opt.buckets)
    # per step: exactly one all-gather of every bucket (one call each), and one reduction
    assert tracker.bytes("all_gather") == steps * param_bytes
    assert tracker.calls("all_gather") == steps * nb
    # Stage 2 reduce-scatters; stage 1 too through shared memory (into its own slice), else
    # it all-reduces its full buffer.
    if stage == 2 or shm.available(None, opt.flat_params[0]):
        assert tracker.bytes("reduce_scatter") == steps * param_bytes
        assert tracker.calls("reduce_scatter") == steps * nb
        assert tracker.bytes("all_reduce") == steps * 4  # only the scalar gradient norm
        assert tracker.calls("all_reduce") == steps
    else:
        assert tracker.calls("reduce_scatter") == 0
        assert tracker.bytes("all_reduce") == steps * (param_bytes + 4)
        assert tracker.calls("all_reduce") == steps * (nb + 1)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2])
@distributed_test(2, 4)
def test_memory_report_follows_zero_formula(
    rank: int, world_size: int, stage: int, precision: str
) -> None:
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    model = make_model(dtype)
    opt = LowLevelZeroOptimizer(
        make_optimizer(model), partition_grad=stage == 2, reduce_bucket_size=64
    )
    x, y = batch(0)
    opt.backward(loss_fn(model, local(x, rank, world_size), local(y, rank, world_size)))
    opt.step()
    opt.backward(loss_fn(model, local(x, rank, world_size), local(y, rank, world_size)))
    report = opt.memory_report()
    padded = sum(b.size for b in opt.buckets)
    shard = padded // world_size
    width = 4 if precision == "fp32" else 2
    assert report.working_params == padded * width
    assert report.grads == (
        shard * (4 if precision == "bf16" else width) if stage == 2 else padded * width
    )
    assert report.master_params == (0 if precision == "fp32" else shard * 4)
    scalar_steps = 4 * len(opt.buckets)  # Adam's "step" counters (fp32 scalars)
    assert report.optimizer_states == 2 * 4 * shard + scalar_steps


@distributed_test(1)
def test_bad_input(rank: int, world_size: int) -> None:
    model = make_model()
    model.head.to(torch.float16)
    with pytest.raises(ValueError, match="mixed dtypes"):
        LowLevelZeroOptimizer(make_optimizer(model))
    model = make_model()
    frozen = make_model().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        LowLevelZeroOptimizer(torch.optim.SGD(frozen.parameters(), lr=1))
    with pytest.raises(TypeError, match="needs a torch.optim.Optimizer"):
        LowLevelZeroOptimizer(model)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"reduce_bucket_size=0 must be a positive"):
        LowLevelZeroOptimizer(make_optimizer(model), reduce_bucket_size=0)
    with pytest.raises(ValueError, match=r"communication_dtype=torch.int8"):
        LowLevelZeroOptimizer(make_optimizer(model), communication_dtype=torch.int8)
    opt = make_optimizer(model)
    loss_fn(model, *batch(0)).backward()
    opt.step()
    with pytest.raises(ValueError, match="already has state"):
        LowLevelZeroOptimizer(opt)


@pytest.mark.parametrize("stage", [1, 2])
@distributed_test(2)
def test_plain_loss_backward_then_step(rank: int, world_size: int, stage: int) -> None:
    # A script that keeps calling loss.backward() still gets reduced gradients at step().
    model = make_model()
    opt = LowLevelZeroOptimizer(
        make_optimizer(model, kind="sgd"), partition_grad=stage == 2, reduce_bucket_size=30
    )
    for step in range(3):
        x, y = batch(step)
        opt.zero_grad()
        loss_fn(model, local(x, rank, world_size), local(y, rank, world_size)).backward()
        opt.step()
    _, ref = reference(3, kind="sgd")
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert relative_error(p, q) <= 1e-5
    if stage == 1:  # a second plain backward on reduced gradients is refused clearly
        x, y = batch(0)
        opt.zero_grad()
        loss_fn(model, local(x, rank, world_size), local(y, rank, world_size)).backward()
        opt.reducer.flush()
        with pytest.raises(RuntimeError, match="call optimizer.backward"):
            loss_fn(model, local(x, rank, world_size), local(y, rank, world_size)).backward()
