"""Parameters left out of the gradient norm (counted by another rank) are left out exactly."""

from __future__ import annotations

import math

import pytest
import torch
from zero_testlib import batch, local, loss_fn, make_model, make_optimizer

from colossal.core.testing import distributed_test
from colossal.zero import LowLevelZeroOptimizer


def _reference_norm(excluded: set[str], norm_type: float) -> float:
    model = make_model()
    x, y = batch(0)
    loss_fn(model, x, y).backward()
    grads = [p.grad for n, p in model.named_parameters() if n not in excluded]
    return float(torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(g, norm_type) for g in grads]), norm_type))


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("stage", [1, 2])
@distributed_test(2)
def test_norm_leaves_out_excluded_parameters(
    rank: int, world_size: int, stage: int, norm_type: float
) -> None:
    """A tiny bucket size makes ``embed.weight`` straddle both ranks' slices."""
    excluded = {"embed.weight", "head.bias"}
    model = make_model()
    opt = LowLevelZeroOptimizer(
        make_optimizer(model), partition_grad=stage == 2, reduce_bucket_size=40,
        norm_type=norm_type,
    )
    named = dict(model.named_parameters())
    opt.exclude_from_norm([named[n] for n in sorted(excluded)])
    x, y = batch(0)
    opt.backward(loss_fn(model, local(x, rank, world_size), local(y, rank, world_size)))
    norm = opt.clip_grad_by_norm(1e9)
    expected = _reference_norm(set() if math.isinf(norm_type) else excluded, norm_type)
    full = _reference_norm(set(), norm_type)
    if not math.isinf(norm_type):
        assert full - expected > 1e-2 * full  # the exclusion is visible at this tolerance
    assert norm == pytest.approx(expected, rel=1e-5)


@distributed_test(1)
def test_foreign_parameter_is_refused(rank: int, world_size: int) -> None:
    model = make_model()
    opt = LowLevelZeroOptimizer(make_optimizer(model))
    with pytest.raises(ValueError, match="not managed"):
        opt.exclude_from_norm([torch.nn.Parameter(torch.zeros(3))])
