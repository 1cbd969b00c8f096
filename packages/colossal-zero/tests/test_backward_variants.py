"""backward_by_grad (plain, lists, split by ``inputs``), communication dtype, no master weights."""

from __future__ import annotations

import pytest
import torch
from zero_testlib import batch, global_loss, local, loss_fn, make_model, make_optimizer, reference

from colossal.core.comm import CommTracker
from colossal.core.testing import distributed_test, relative_error
from colossal.zero import LowLevelZeroOptimizer

STEPS = 3
BF16_TOL = 3e-2  # bf16 rounding of gradients or weights, against the fp32 reference


def _by_grad_step(opt: LowLevelZeroOptimizer, model: torch.nn.Module, x, y, how: str) -> None:
    """One backward through ``backward_by_grad``: the head's output and its gradient."""
    h = model.body(model.embed(x.to(next(model.parameters()).dtype)))
    cut = h.detach().requires_grad_(True)  # the boundary between two "stages"
    out = model.head(cut) + model.branch(cut)
    loss = (out.float() - y).pow(2).mean()
    # the gradient of the *scaled* loss, as a later pipeline stage would send it
    (g,) = torch.autograd.grad(loss * opt.loss_scale, out)
    opt.backward_by_grad(out, g, retain_graph=True)  # the "last stage"
    if how == "tensor":
        opt.backward_by_grad(h, cut.grad)
    elif how == "list":
        opt.backward_by_grad([h], [cut.grad])
    else:  # ZB-V's split: input gradients first (none here but x), weight gradients later
        x_leaf = x.to(h.dtype).requires_grad_(True)
        h = model.body(model.embed(x_leaf))
        with opt.no_sync():
            opt.backward_by_grad([h], [cut.grad], inputs=[x_leaf], retain_graph=True)
        assert all(p.grad is None or not p.grad.any() for p in model.embed.parameters()), (
            "an input-only backward reached the parameters"
        )
        opt.backward_by_grad([h], [cut.grad], inputs=list(model.parameters()))


@pytest.mark.parametrize("how", ["tensor", "list", "split"])
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@distributed_test(2)
def test_backward_by_grad_equals_backward(
    rank: int, world_size: int, precision: str, how: str
) -> None:
    dtype = torch.float32 if precision == "fp32" else torch.float16
    stages = [1] if how == "split" else [1, 2]  # no_sync (the split) is stage 1 only
    for stage in stages:
        models, opts = [], []
        for _ in range(2):
            model = make_model(dtype)
            models.append(model)
            opts.append(
                LowLevelZeroOptimizer(
                    make_optimizer(model, kind="sgd"),
                    partition_grad=stage == 2,
                    reduce_bucket_size=40,
                    initial_scale=2**8,
                )
            )
        for step in range(STEPS):
            x, y = batch(step)
            x, y = local(x, rank, world_size), local(y, rank, world_size)
            for opt in opts:
                opt.zero_grad()
            opts[0].backward(loss_fn(models[0], x, y))
            _by_grad_step(opts[1], models[1], x, y, how)
            for opt in opts:
                opt.step()
            assert opts[1].get_grad_norm() == pytest.approx(opts[0].get_grad_norm(), rel=1e-5)
        tol = 1e-6 if precision == "fp32" else 2e-3
        for (name, p), q in zip(models[1].named_parameters(), models[0].parameters(), strict=True):
            err = relative_error(p.float(), q.float())
            assert err <= tol, f"stage {stage} {how}: {name} relative error {err:.2e}"
        if precision == "fp32":
            _, ref = reference(STEPS, kind="sgd")
            for p, q in zip(models[1].parameters(), ref.parameters(), strict=True):
                assert relative_error(p, q) <= 1e-5


@distributed_test(1)
def test_backward_by_grad_bad_input(rank: int, world_size: int) -> None:
    model = make_model()
    opt = LowLevelZeroOptimizer(make_optimizer(model))
    out = model(torch.randn(2, 6))
    with pytest.raises(ValueError, match="2 tensors but 1 gradients"):
        opt.backward_by_grad([out, out], [torch.ones_like(out)])
    with pytest.raises(TypeError, match="grad must be a tensor or a sequence of tensors"):
        opt.backward_by_grad(out, 1.0)  # type: ignore[arg-type]


def _comm_run(
    rank: int, world_size: int, stage: int, comm_dtype: torch.dtype | None
) -> tuple[list[float], torch.nn.Module, int]:
    """Train STEPS steps; return losses, the model and the gradient-reduction bytes of one step."""
    model = make_model()
    opt = LowLevelZeroOptimizer(
        make_optimizer(model),
        partition_grad=stage == 2,
        reduce_bucket_size=40,
        communication_dtype=comm_dtype,
    )
    losses, reduced = [], 0
    for step in range(STEPS):
        x, y = batch(step)
        loss = loss_fn(model, local(x, rank, world_size), local(y, rank, world_size))
        opt.zero_grad()
        with CommTracker() as tracker:
            opt.backward(loss)
            opt.step()
        # gradients only: the norm's fp32 scalar all-reduce is left out
        reduced = tracker.bytes("reduce_scatter") + tracker.bytes("all_reduce") - 4
        losses.append(global_loss(loss))
    return losses, model, reduced


@pytest.mark.parametrize("stage", [1, 2])
@distributed_test(2)
def test_bf16_communication_of_fp32_gradients(rank: int, world_size: int, stage: int) -> None:
    losses, model, bf16_bytes = _comm_run(rank, world_size, stage, torch.bfloat16)
    _, _, fp32_bytes = _comm_run(rank, world_size, stage, None)
    assert fp32_bytes > 0 and bf16_bytes * 2 == fp32_bytes, (bf16_bytes, fp32_bytes)
    ref_losses, ref = reference(STEPS)
    assert relative_error(torch.tensor(losses), torch.tensor(ref_losses)) <= BF16_TOL
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert p.dtype == torch.float32
        err = relative_error(p, q)
        assert err <= BF16_TOL, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("stage", [1, 2])
@distributed_test(2)
def test_bf16_without_master_weights(rank: int, world_size: int, stage: int) -> None:
    model = make_model(torch.bfloat16)
    opt = LowLevelZeroOptimizer(
        make_optimizer(model), partition_grad=stage == 2, reduce_bucket_size=40,
        master_weights=False,
    )
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        opt.backward(loss_fn(model, local(x, rank, world_size), local(y, rank, world_size)))
        opt.step()
    report = opt.memory_report()
    assert report.master_params == 0
    assert all(m.dtype == torch.bfloat16 for m in opt.masters)
    _, ref = reference(STEPS)
    start = make_model()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        err = relative_error(p.float(), q)
        moved = relative_error(q, start.get_parameter(name))
        # within tolerance, and well below how far training moved it (updates not lost)
        assert err <= min(BF16_TOL, moved / 4), f"{name}: error {err:.2e}, moved {moved:.2e}"
