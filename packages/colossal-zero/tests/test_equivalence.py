"""ZeRO stage 1/2 at world 1, 2, 4 matches a single-process run on the global batch."""

from __future__ import annotations

import os

import pytest
import torch
from zero_testlib import batch, global_loss, local, loss_fn, make_model, make_optimizer, reference

from colossal.core.testing import distributed_test, relative_error
from colossal.zero import LowLevelZeroOptimizer

# fp32 must match to 1e-5; half precisions are compared with the fp32 reference.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
STEPS = 5


def _train_and_compare(
    rank: int, world_size: int, stage: int, dtype: torch.dtype, kind: str
) -> None:
    model = make_model(dtype)
    opt = LowLevelZeroOptimizer(
        make_optimizer(model, kind=kind),
        partition_grad=stage == 2,
        reduce_bucket_size=70,
        initial_scale=2**8,
    )
    assert len(opt.buckets) > 2, "the test wants several buckets"
    losses, norms = [], []
    for step in range(STEPS):
        x, y = batch(step)
        loss = loss_fn(model, local(x, rank, world_size), local(y, rank, world_size))
        opt.zero_grad()
        opt.backward(loss)
        opt.step()
        losses.append(global_loss(loss))
        norms.append(opt.get_grad_norm())
    ref_norms: list[float] = []
    ref_losses, ref_model = reference(STEPS, kind=kind, norms=ref_norms)
    tol = TOLERANCE[dtype]
    assert relative_error(torch.tensor(losses), torch.tensor(ref_losses)) <= tol
    assert relative_error(torch.tensor(norms), torch.tensor(ref_norms)) <= 10 * tol
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        err = relative_error(p.float(), q)
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("precision", list(DTYPES))
@pytest.mark.parametrize("stage", [1, 2])
@distributed_test(1, 2, 4)
def test_matches_single_process(rank: int, world_size: int, stage: int, precision: str) -> None:
    _train_and_compare(rank, world_size, stage, DTYPES[precision], "adamw")


@pytest.mark.parametrize("stage", [1, 2])
@distributed_test(2, 4)
def test_sgd_sees_averaged_gradients(rank: int, world_size: int, stage: int) -> None:
    # SGD, unlike Adam, changes with the gradients' scale: catches a wrong averaging factor.
    _train_and_compare(rank, world_size, stage, torch.float32, "sgd")


@pytest.mark.parametrize("overlap", [True, False])
@distributed_test(2)
def test_overlap_and_comm_dtype(rank: int, world_size: int, overlap: bool) -> None:
    model = make_model()
    opt = LowLevelZeroOptimizer(
        make_optimizer(model),
        partition_grad=True,
        reduce_bucket_size=50,
        overlap_communication=overlap,
        communication_dtype=torch.float32,
        cpu_offload=True,
    )
    for step in range(3):
        x, y = batch(step)
        opt.zero_grad()
        opt.backward(loss_fn(model, local(x, rank, world_size), local(y, rank, world_size)))
        opt.step()
    _, ref = reference(3)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert relative_error(p, q) <= 1e-5


@pytest.mark.parametrize("stage", [1, 2])
@distributed_test(2, 4)
def test_allgather_overlapped_with_next_forward(rank: int, world_size: int, stage: int) -> None:
    os.environ["COLOSSAL_SHM_COMM"] = "0"  # through shared memory the gather is synchronous
    model = make_model()
    opt = LowLevelZeroOptimizer(
        make_optimizer(model, kind="sgd"), partition_grad=stage == 2, reduce_bucket_size=40,
        overlap_allgather=True,
    )
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        opt.backward(loss_fn(model, local(x, rank, world_size), local(y, rank, world_size)))
        opt.step()
        assert opt.gatherer._pending, "step waited for the all-gather instead of deferring it"
    opt.wait_params()
    _, ref = reference(STEPS, kind="sgd")
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert relative_error(p, q) <= 1e-5
