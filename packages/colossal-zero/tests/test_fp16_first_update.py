"""fp16 ZeRO's first update equals fp32 SGD's, closer than a 2x loss-scale error would allow.

Plain SGD moves each parameter by ``lr * (grad + weight_decay * p)``: a gradient unscaled by
a wrong loss scale moves it visibly too far or too short from the very first step, with no
overflow needed to notice. The fp32 masters' update is compared with fp32 SGD's from the
same (fp16-rounded) starting weights on the same global batch; the tolerance is asserted to
lie well below the error a gradient off by 2x (either way) produces.

``growth_interval=1`` makes the loss scale grow at the end of the first clean step: the
unscale must use the scale the loss was multiplied by, not the grown one.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from zero_testlib import batch, local, loss_fn, make_model, make_optimizer

from colossal.core.testing import distributed_test, relative_error
from colossal.zero import LowLevelZeroOptimizer

LR = 1e-2  # SGD's lr is 10x this (see ``make_optimizer``)
SCALE = 2.0**8
#: Relative error of the masters' update against fp32 SGD's (fp16 forward/backward: about
#: 1e-3 measured).
TOL = 1e-2
#: The error of a 2x-off gradient must exceed the tolerance by at least this factor.
MARGIN = 10.0


def _start() -> nn.Module:
    """The fp32 reference model at the fp16 model's (rounded) starting weights."""
    model = make_model()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    return model


def _reference_update(grad_factor: float) -> list[torch.Tensor]:
    """Each parameter's change after one fp32 SGD step with gradients times ``grad_factor``."""
    model = _start()
    before = [p.detach().clone() for p in model.parameters()]
    opt = make_optimizer(model, lr=LR, kind="sgd_plain")
    x, y = batch(0)
    loss_fn(model, x, y).backward()
    for p in model.parameters():
        p.grad.mul_(grad_factor)
    opt.step()
    return [p.detach() - b for p, b in zip(model.parameters(), before, strict=True)]


@pytest.mark.parametrize("growth_interval", [1000, 1])
@pytest.mark.parametrize("stage", [1, 2])
@distributed_test(1, 2)
def test_first_fp16_update_matches_fp32_sgd(
    rank: int, world_size: int, stage: int, growth_interval: int
) -> None:
    model = make_model(torch.float16)
    start = [p.detach().float().clone() for p in model.parameters()]
    inner = make_optimizer(model, lr=LR, kind="sgd_plain")
    # state_dict keys are positions in the optimizer's groups, not in named_parameters()
    position = {id(p): i for i, p in enumerate(p for g in inner.param_groups for p in g["params"])}
    keys = [position[id(p)] for p in model.parameters()]
    opt = LowLevelZeroOptimizer(
        inner,
        partition_grad=stage == 2,
        reduce_bucket_size=70,  # several buckets, parameters straddling rank slices
        initial_scale=SCALE,
        growth_interval=growth_interval,
    )
    x, y = batch(0)
    opt.backward(loss_fn(model, local(x, rank, world_size), local(y, rank, world_size)))
    opt.step()
    assert opt.get_grad_norm() is not None, "the first step was skipped"
    expected_scale = SCALE * (2 if growth_interval == 1 else 1)
    assert opt.loss_scale == expected_scale, "the scale did not follow growth_interval"
    masters = opt.state_dict()["state"]  # full fp32 masters, every rank (collective)

    expected = _reference_update(1.0)
    doubled, halved = _reference_update(2.0), _reference_update(0.5)
    names = [n for n, _ in model.named_parameters()]
    for i, name in enumerate(names):
        # What a loss scale off by 2x would do to this parameter's update.
        off_by_2x = min(
            relative_error(doubled[i], expected[i]), relative_error(halved[i], expected[i])
        )
        assert TOL * MARGIN < off_by_2x, f"{name}: a 2x error ({off_by_2x:.2e}) hides in TOL"
        update = masters[keys[i]]["master_param"].reshape(start[i].shape) - start[i]
        err = relative_error(update, expected[i])
        assert err <= TOL, (
            f"{name}: update off by {err:.2e} relative (a 2x loss-scale error gives "
            f"{off_by_2x:.2e})"
        )
