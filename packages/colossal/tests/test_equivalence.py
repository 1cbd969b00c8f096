"""Every plugin x precision at world 1/2/4 matches the single-process fp32 reference."""

from __future__ import annotations

import torch
from booster_testlib import (
    full_state,
    make_booster,
    make_model,
    make_optimizer,
    reference,
    train_steps,
)

from colossal.core.testing import distributed_test

STEPS = 5
TOL = {"fp32": 1e-5, "bf16": 4e-2, "fp16": 1e-2}
# Under ZeRO the whole model is fp16 (not autocast), so it drifts further from fp32.
ZERO_FP16_TOL = 5e-2


def _run(rank: int, world_size: int, plugin: str, precision: str) -> None:
    kwargs = {"initial_scale": 2**8} if plugin.startswith("zero") and precision == "fp16" else {}
    booster = make_booster(plugin, precision, **kwargs)
    model = make_model()
    optimizer = make_optimizer(model)
    model, optimizer, *_ = booster.boost(model, optimizer)
    losses = train_steps(model, optimizer, booster, range(STEPS), rank, world_size)
    ref_losses, ref_state = reference(STEPS)
    state = full_state(model, booster)
    tol = ZERO_FP16_TOL if kwargs else TOL[precision]
    where = f"{plugin}/{precision} at world {world_size}"
    torch.testing.assert_close(
        torch.tensor(losses),
        torch.tensor(ref_losses),
        rtol=tol,
        atol=tol,
        msg=lambda m: f"{where}: losses differ from the reference: {m}",
    )
    assert state.keys() == ref_state.keys(), where
    for name, ref in ref_state.items():
        torch.testing.assert_close(
            state[name], ref, rtol=tol, atol=tol, msg=lambda m, n=name: f"{where} {n}: {m}"
        )


@distributed_test(1, 2, 4)
def test_plugins_fp32(rank: int, world_size: int) -> None:
    # One spawn per world size for all plugins keeps the suite fast.
    for plugin in ("ddp", "zero1", "zero2", "fsdp"):
        _run(rank, world_size, plugin, "fp32")
    if world_size == 1:  # no plugin: the plain model, booster-level mixed precision
        _run(rank, world_size, "none", "fp32")
        _run(rank, world_size, "none", "bf16")


@distributed_test(2)
def test_plugins_mixed_precision(rank: int, world_size: int) -> None:
    for plugin, precision in [
        ("ddp", "bf16"),
        ("ddp", "fp16"),
        ("zero1", "bf16"),
        ("zero2", "fp16"),
        ("zero1", "fp16"),
        ("fsdp", "bf16"),
    ]:
        _run(rank, world_size, plugin, precision)


def test_fp32_reference_differs_from_bf16() -> None:
    """The tolerances are tight enough to tell precisions apart (tests can fail)."""
    ref_losses, _ = reference(STEPS)
    assert abs(ref_losses[-1] - ref_losses[0]) > TOL["bf16"]
