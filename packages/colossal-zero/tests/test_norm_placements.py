"""ZeRO's gradient norm counts each element of the model once, whatever its placements.

The norm is colossal.core's, over each parameter's placements followed by its slice here:
a parameter replicated along another axis (recorded with ``mark_sharded``, or implied by
``tp_process_group``) counts on that axis' first rank only; one split along it counts each
part. A tiny bucket size makes parameters straddle the data-parallel slices.
"""

from __future__ import annotations

import math

import pytest
import torch
from zero_testlib import IN, batch, local, loss_fn, make_model, make_optimizer

from colossal.core import Block, Placement, ProcessGroupMesh, Replicate, mark_sharded
from colossal.core.testing import distributed_test
from colossal.zero import LowLevelZeroOptimizer


def _reference_norm(norm_type: float) -> float:
    model = make_model()
    x, y = batch(0)
    loss_fn(model, x, y).backward()
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf, norm_type))


@pytest.mark.parametrize("how", ["marked", "implied"])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("stage", [1, 2])
@distributed_test(4)
def test_replicated_axis_counts_once(
    rank: int, world_size: int, stage: int, norm_type: float, how: str
) -> None:
    """dp 2 x tp 2, the model replicated over tp: the norm is the single-process model's
    (counting both tp ranks would make a 2-norm sqrt(2) times larger)."""
    mesh = ProcessGroupMesh(2, 2, axis_names=("dp", "tp"))
    dp, tp = mesh.get_group_along_axis("dp"), mesh.get_group_along_axis("tp")
    model = make_model()
    if how == "marked":
        for p in model.parameters():
            mark_sharded(p, Placement("tp", Replicate(), tp), p.shape)
    opt = LowLevelZeroOptimizer(
        make_optimizer(model), partition_grad=stage == 2, reduce_bucket_size=40,
        norm_type=norm_type, dp_process_group=dp,
        tp_process_group=tp if how == "implied" else None,
    )
    x, y = batch(0)
    d = mesh.coordinate("dp")
    opt.backward(loss_fn(model, local(x, d, 2), local(y, d, 2)))
    norm = opt.clip_grad_by_norm(1e9)
    assert norm == pytest.approx(_reference_norm(norm_type), rel=1e-5)


@distributed_test(4)
def test_split_axis_counts_every_part(rank: int, world_size: int) -> None:
    """dp 2 x tp 2, each tp rank holding its rows of a Linear(IN, 6) (marked as a block of the
    whole weight): the norm covers both tp parts, gradients averaged over dp only."""
    mesh = ProcessGroupMesh(2, 2, axis_names=("dp", "tp"))
    dp, tp = mesh.get_group_along_axis("dp"), mesh.get_group_along_axis("tp")
    d, t = mesh.coordinate("dp"), mesh.coordinate("tp")

    def whole() -> torch.nn.Linear:
        torch.manual_seed(50)
        return torch.nn.Linear(IN, 6)

    ref = whole()
    x, _ = batch(0)
    ref(x).pow(2).mean().backward()
    part = torch.nn.Linear(IN, 3)
    with torch.no_grad():
        part.weight.copy_(ref.weight[3 * t : 3 * t + 3])
        part.bias.copy_(ref.bias[3 * t : 3 * t + 3])
    mark_sharded(part.weight, Block.along((6, IN), 0, 3 * t, 3 * t + 3), (6, IN), tp)
    mark_sharded(part.bias, Block.along((6,), 0, 3 * t, 3 * t + 3), (6,), tp)
    opt = LowLevelZeroOptimizer(torch.optim.SGD(part.parameters(), lr=0.1), dp_process_group=dp)
    xs = local(x, d, 2)
    # The whole model's loss is the mean over 6 outputs; this rank's 3 enter it alone.
    opt.backward(part(xs).pow(2).sum() / (len(xs) * 6))
    opt.step()
    expected = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), math.inf))
    assert opt.get_grad_norm() == pytest.approx(expected, rel=1e-5)
