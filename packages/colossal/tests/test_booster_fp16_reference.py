"""fp16 under the Booster against the fp32 reference, with optimizers that see the grads' scale.

AdamW divides each gradient by its own running magnitude, so an fp16 run that forgets to
divide by the loss scale still matches an AdamW reference (``test_equivalence``). These
cases cannot:

- ``sgd``: SGD without momentum moves each parameter by ``lr * grad``; a gradient left
  scaled moves it ``loss_scale`` times too far.
- ``adamw_clip``: AdamW (``eps`` of the order of the gradients, so that their magnitude
  matters) with ``clip_grad_by_norm(max_norm)`` where ``max_norm`` lies between the steps'
  gradient norms, so some steps clip and others do not (asserted on the reference). A
  gradient left scaled is too large where it is not clipped (ZeRO clips with the unscaled
  norm), or clipped at every step (DDP clips after unscaling); a norm left scaled is
  reported (and compared) wrongly.

fp16 is what ``Booster(mixed_precision="fp16")`` does with ``TorchDDPPlugin`` (autocast,
fp32 parameters) and what ``LowLevelZeroPlugin(precision="fp16")`` does (fp16 parameters,
fp32 masters). Each tolerance is smaller than the change it guards: every parameter of the
reference moves by more than ``MOVE_FACTOR`` tolerances.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from booster_testlib import batch, full_state, local_batch, make_model
from torch import nn

from colossal.booster import Booster, MixedPrecision
from colossal.core.testing import distributed_test, relative_error

STEPS = 5
LR = {"sgd": 0.2, "adamw_clip": 3e-2}
#: Relative error of each parameter (and of the losses and norms) against the fp32 reference.
TOL = 2e-3
MOVE_FACTOR = 3.0
#: Between the reference's gradient norms (asserted): some steps clip, others do not.
CLIP = 0.9
INITIAL_SCALE = 2.0**8


def _optimizer(model: nn.Module, case: str) -> torch.optim.Optimizer:
    if case == "sgd":
        return torch.optim.SGD(model.parameters(), lr=LR[case])
    # eps of the order of the gradients' elements: the update depends on their magnitude,
    # not only on their direction (with eps=1e-8 AdamW ignores a constant scale).
    return torch.optim.AdamW(model.parameters(), lr=LR[case], weight_decay=0.1, eps=1e-2)


def _reference(case: str) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """Single-process fp32 on the global batch: losses, gradient norms, final parameters."""
    model = make_model()
    optimizer = _optimizer(model, case)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        max_norm = CLIP if case == "adamw_clip" else float("inf")
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _booster(plugin: str) -> Booster:
    from colossal.booster.plugin import LowLevelZeroPlugin, TorchDDPPlugin

    if plugin == "ddp":
        return Booster(
            plugin=TorchDDPPlugin(),
            mixed_precision=MixedPrecision("fp16", initial_scale=INITIAL_SCALE),
        )
    stage = int(plugin[-1])
    return Booster(
        plugin=LowLevelZeroPlugin(stage=stage, precision="fp16", initial_scale=INITIAL_SCALE)
    )


def _global_mean(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    torch.distributed.all_reduce(t)
    return float(t) / torch.distributed.get_world_size()


def _train(
    booster: Booster, case: str, rank: int, world_size: int
) -> tuple[list[float], list[float], Any]:
    plain = make_model()
    model, optimizer, *_ = booster.boost(plain, _optimizer(plain, case))
    losses, norms = [], []
    for step in range(STEPS):
        x, y = local_batch(step, rank, world_size)
        loss = nn.functional.mse_loss(model(x).float(), y)
        booster.backward(loss, optimizer)
        if case == "adamw_clip":
            norms.append(optimizer.clip_grad_by_norm(CLIP))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(_global_mean(float(loss.detach())))
    return losses, norms, model


@pytest.mark.parametrize("case", ["sgd", "adamw_clip"])
@pytest.mark.parametrize("plugin", ["ddp", "zero1", "zero2"])
@distributed_test(2)
def test_fp16_matches_fp32_reference(rank: int, world_size: int, plugin: str, case: str) -> None:
    booster = _booster(plugin)
    losses, norms, model = _train(booster, case, rank, world_size)
    ref_losses, ref_norms, ref_state = _reference(case)
    where = f"{plugin}/fp16/{case}"
    if case == "adamw_clip":
        clipped = sum(n > CLIP for n in ref_norms)
        assert 0 < clipped < STEPS, f"CLIP={CLIP} must clip some steps only: {ref_norms}"
        err = relative_error(torch.tensor(norms), torch.tensor(ref_norms))
        assert err <= TOL, f"{where}: grad norms {norms} vs reference {ref_norms}"
    err = relative_error(torch.tensor(losses), torch.tensor(ref_losses))
    assert err <= TOL, f"{where}: losses {losses} vs reference {ref_losses}"
    start = make_model().state_dict()
    state = full_state(model, booster)
    for name, ref in ref_state.items():
        if name == "offset":  # a buffer: never trained
            continue
        moved = relative_error(ref, start[name])
        assert moved > MOVE_FACTOR * TOL, f"{name} moved by {moved:.1e} only: raise LR/STEPS"
        err = relative_error(state[name], ref)
        assert err <= TOL, f"{where} {name}: relative error {err:.2e} (moved {moved:.1e})"
