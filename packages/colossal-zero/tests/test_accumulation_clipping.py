"""Gradient accumulation (no_sync) and clipping against the single-process reference."""

from __future__ import annotations

import pytest
import torch
from zero_testlib import batch, local, loss_fn, make_model, make_optimizer, reference

from colossal.core.comm import CommTracker, shm
from colossal.core.testing import distributed_test, relative_error
from colossal.zero import LowLevelZeroOptimizer

STEPS = 4


def _micro_batches(
    step: int, rank: int, world_size: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = batch(step)
    x, y = local(x, rank, world_size), local(y, rank, world_size)
    half = x.shape[0] // 2
    return [(x[:half], y[:half]), (x[half:], y[half:])]


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@distributed_test(1, 2, 4)
def test_no_sync_accumulation_stage1(rank: int, world_size: int, kind: str) -> None:
    model = make_model()
    opt = LowLevelZeroOptimizer(make_optimizer(model, kind=kind), reduce_bucket_size=64)
    for step in range(STEPS):
        opt.zero_grad()
        (x0, y0), (x1, y1) = _micro_batches(step, rank, world_size)
        with opt.no_sync():
            opt.backward(loss_fn(model, x0, y0) / 2)
        opt.backward(loss_fn(model, x1, y1) / 2)
        opt.step()
    _, ref = reference(STEPS, kind=kind)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert relative_error(p, q) <= 1e-5


@pytest.mark.parametrize("overlap", [True, False])
@distributed_test(2)
def test_no_sync_does_not_communicate(rank: int, world_size: int, overlap: bool) -> None:
    # Catches a no_sync that still reduces (it would also pass the accumulation test above:
    # a reduction of the first micro-batch only changes when, not what, is averaged).
    model = make_model()
    opt = LowLevelZeroOptimizer(
        make_optimizer(model), reduce_bucket_size=64, overlap_communication=overlap
    )
    numel = sum(p.numel() for p in model.parameters())
    (x0, y0), (x1, y1) = _micro_batches(0, rank, world_size)
    opt.zero_grad()
    with CommTracker() as accumulating:
        with opt.no_sync():
            opt.backward(loss_fn(model, x0, y0) / 2)
            opt.backward(loss_fn(model, x1, y1) / 4)
    assert (accumulating.calls(), accumulating.bytes()) == (0, 0), accumulating.table()
    with CommTracker() as synced:
        opt.backward(loss_fn(model, x1, y1) / 4)
    # One reduction per bucket, of every gradient once (stage 1 keeps full gradients): a
    # reduce-scatter into this rank's slice through shared memory, else an all-reduce.
    kind = "reduce_scatter" if shm.available(None, opt.flat_params[0]) else "all_reduce"
    assert synced.calls() == synced.calls(kind) == len(opt.buckets), synced.table()
    assert synced.bytes(kind) == 4 * numel, synced.table()
    with CommTracker() as stepping:
        opt.step()
    # The step gathers the updated parameters (and agrees on the norm); it reduces nothing.
    assert stepping.calls("all_gather") == len(opt.buckets), stepping.table()
    assert stepping.bytes("all_gather") == 4 * numel, stepping.table()
    assert stepping.bytes("all_reduce") <= 8, stepping.table()


@pytest.mark.parametrize("stage", [1, 2])
@distributed_test(2, 4)
def test_accumulation_with_communication_each_time(rank: int, world_size: int, stage: int) -> None:
    # Two synced backward calls per step: stage 1 must not count the first reduction twice.
    model = make_model()
    opt = LowLevelZeroOptimizer(
        make_optimizer(model, kind="sgd"), partition_grad=stage == 2, reduce_bucket_size=64
    )
    for step in range(STEPS):
        opt.zero_grad()
        for x, y in _micro_batches(step, rank, world_size):
            opt.backward(loss_fn(model, x, y) / 2)
        opt.step()
    _, ref = reference(STEPS, kind="sgd")
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert relative_error(p, q) <= 1e-5


@distributed_test(2)
def test_no_sync_refused_under_stage2(rank: int, world_size: int) -> None:
    model = make_model()
    opt = LowLevelZeroOptimizer(make_optimizer(model), partition_grad=True)
    with pytest.raises(RuntimeError, match=r"no_sync\(\) needs full local gradients.*stage 2"):
        with opt.no_sync():
            pass


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("how", ["constructor", "method"])
@distributed_test(1, 2, 4)
def test_clipping_matches_torch(rank: int, world_size: int, stage: int, how: str) -> None:
    clip = 0.05  # well below the gradient norms, so every step clips
    model = make_model()
    opt = LowLevelZeroOptimizer(
        make_optimizer(model, kind="sgd"),
        partition_grad=stage == 2,
        reduce_bucket_size=64,
        clip_grad_norm=clip if how == "constructor" else 0.0,
    )
    norms = []
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        opt.backward(loss_fn(model, local(x, rank, world_size), local(y, rank, world_size)))
        if how == "method":
            norms.append(opt.clip_grad_by_norm(clip))
        opt.step()
        norms.append(opt.get_grad_norm()) if how == "constructor" else None
    ref_norms: list[float] = []
    _, ref = reference(STEPS, clip=clip, kind="sgd", norms=ref_norms)
    assert min(ref_norms) > clip
    assert relative_error(torch.tensor(norms), torch.tensor(ref_norms)) <= 1e-5
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert relative_error(p, q) <= 1e-5
