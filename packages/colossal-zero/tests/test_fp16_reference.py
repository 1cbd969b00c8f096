"""fp16 ZeRO against the fp32 reference with optimizers that see the gradients' scale.

AdamW divides each gradient by its own running magnitude, so it barely notices a gradient
that still carries the loss scale: an fp16 run that forgot to unscale passes an AdamW
comparison. These cases cannot pass that way:

- SGD without momentum moves each parameter by ``lr * grad``: an unscaled gradient moves it
  ``loss_scale`` times too far.
- AdamW with clipping to a ``max_norm`` below every step's gradient norm: the returned norm
  must be the unscaled one, and with ``eps`` of the order of the clipped gradients the
  update depends on their magnitude, so clipping the wrong gradient shows.

Each tolerance is smaller than the change it guards: every parameter must move by more than
``MOVE_FACTOR`` times the tolerance over the steps.
"""

from __future__ import annotations

import pytest
import torch
from zero_testlib import batch, local, loss_fn, make_model, make_optimizer, reference

from colossal.core.testing import distributed_test, relative_error
from colossal.zero import LowLevelZeroOptimizer

STEPS = 5
#: SGD's lr is 10x this (see ``make_optimizer``): large enough that every parameter moves.
LR = 3e-2
#: Relative error of fp16 parameters (fp32 masters) against the fp32 reference (measured
#: up to 6e-4 at world 2).
TOL = 1.5e-3
#: Every parameter moves by at least this many tolerances, so a run that barely moves (or
#: moves wrongly) cannot pass.
MOVE_FACTOR = 3.0
#: Below every step's gradient norm in the reference (asserted), so each step clips.
CLIP = 0.05
CASES = {"sgd": ("sgd_plain", 0.0), "adamw_clip": ("adamw_eps", CLIP)}


def _train_fp16(
    rank: int, world_size: int, stage: int, kind: str, clip: float
) -> tuple[torch.nn.Module, list[float]]:
    model = make_model(torch.float16)
    opt = LowLevelZeroOptimizer(
        make_optimizer(model, lr=LR, kind=kind),
        partition_grad=stage == 2,
        reduce_bucket_size=70,
        initial_scale=2**8,
    )
    norms = []
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        opt.backward(loss_fn(model, local(x, rank, world_size), local(y, rank, world_size)))
        if clip:
            norms.append(opt.clip_grad_by_norm(clip))
        opt.step()
        norm = opt.get_grad_norm()
        assert norm is not None and torch.isfinite(torch.tensor(norm)), "a step was skipped"
        if not clip:
            norms.append(norm)
    return model, norms


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("stage", [1, 2])
@distributed_test(2)
def test_fp16_matches_fp32_reference(rank: int, world_size: int, stage: int, case: str) -> None:
    kind, clip = CASES[case]
    model, norms = _train_fp16(rank, world_size, stage, kind, clip)
    ref_norms: list[float] = []
    _, ref = reference(STEPS, clip=clip, kind=kind, norms=ref_norms, lr=LR)
    if clip:
        assert min(ref_norms) > clip, f"max_norm={clip} does not clip: norms {ref_norms}"
    # The norms are of the unscaled, averaged gradients.
    norm_err = relative_error(torch.tensor(norms), torch.tensor(ref_norms))
    assert norm_err <= TOL, f"grad norms {norms} vs reference {ref_norms}"
    start = make_model()
    named = zip(model.named_parameters(), ref.parameters(), start.parameters(), strict=True)
    for (name, p), q, p0 in named:
        moved = relative_error(q, p0)
        assert moved > MOVE_FACTOR * TOL, f"{name} moved by {moved:.1e} only: raise lr/steps"
        err = relative_error(p.float(), q)
        assert err <= TOL, f"{name}: relative error {err:.2e} > {TOL:.0e} (moved {moved:.1e})"
