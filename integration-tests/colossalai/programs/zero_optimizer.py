"""LowLevelZeroOptimizer used directly, as ColossalAI's tests/test_zero/test_low_level
(test_zero1_2.py) does: ZeRO-1 and ZeRO-2 agree exactly, and ZeRO-1 matches torch DDP.

Each rank feeds its own batch. ZeRO-1 (``partition_grad=False``) and ZeRO-2
(``partition_grad=True``) must give equal gradients (``get_param_grad``) and equal
parameters after the step; ZeRO with SGD must match ``DistributedDataParallel`` with SGD in
gradients and updated parameters (to fp32 rounding).
"""

import copy

import colossalai
import torch
import torch.nn as nn
from colossalai.testing import assert_close, rerun_if_address_is_in_use, spawn
from colossalai.testing.random import seed_all
from colossalai.zero.low_level import LowLevelZeroOptimizer
from torch.nn.parallel import DistributedDataParallel


class MlpModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear1 = nn.Linear(123, 253)
        self.linear_drop = nn.Linear(253, 253)  # unused in forward: no gradient
        self.linear2 = nn.Linear(253, 512)

    def forward(self, x):
        return self.linear2(self.linear1(x))


def exam_zero_1_2(rank: int) -> None:
    seed_all(2001)
    zero1_model = MlpModel()
    zero2_model = copy.deepcopy(zero1_model)
    zero1_optimizer = LowLevelZeroOptimizer(
        torch.optim.Adam(zero1_model.parameters(), lr=1e-3),
        overlap_communication=True, initial_scale=128, verbose=True,
    )  # fmt: skip
    zero2_optimizer = LowLevelZeroOptimizer(
        torch.optim.Adam(zero2_model.parameters(), lr=1e-3),
        overlap_communication=True, partition_grad=True, initial_scale=128,
    )  # fmt: skip
    seed_all(2001 + rank)
    input_data = torch.randn(32, 123)
    zero1_output = zero1_model(input_data)
    zero2_output = zero2_model(input_data)
    assert torch.equal(zero1_output, zero2_output)
    zero1_optimizer.backward(zero1_output.mean().float())
    zero2_optimizer.backward(zero2_output.mean().float())
    for p1, p2 in zip(zero1_model.parameters(), zero2_model.parameters(), strict=True):
        g1, g2 = zero1_optimizer.get_param_grad(p1), zero2_optimizer.get_param_grad(p2)
        if g1 is None or g2 is None:  # linear_drop
            assert (g1 is None or not g1.any()) and (g2 is None or not g2.any())
            continue
        assert torch.equal(g1, g2)
    zero1_optimizer.step()
    zero2_optimizer.step()
    for z1p, z2p in zip(zero1_model.parameters(), zero2_model.parameters(), strict=True):
        assert torch.equal(z1p.data, z2p.data)


def exam_zero_1_torch_ddp(rank: int) -> None:
    seed_all(1453)
    torch_model = MlpModel()
    zero_model = copy.deepcopy(torch_model)
    torch_model = DistributedDataParallel(torch_model, find_unused_parameters=True)
    zero_optimizer = LowLevelZeroOptimizer(
        torch.optim.SGD(zero_model.parameters(), lr=1),
        overlap_communication=True, initial_scale=1, reduce_bucket_size=1024 * 1024,
    )  # fmt: skip
    torch_optimizer = torch.optim.SGD(torch_model.parameters(), lr=1)
    seed_all(1453 + rank)
    input_data = torch.rand(32, 123)
    zero_output = zero_model(input_data)
    torch_output = torch_model(input_data)
    assert_close(zero_output, torch_output)
    zero_optimizer.backward(zero_output.mean().float())
    torch_output.mean().backward()
    checked = 0
    for p, z1p in zip(torch_model.parameters(), zero_model.parameters(), strict=True):
        zero_grad = zero_optimizer.get_param_grad(z1p)
        if p.grad is None:  # linear_drop: ColossalAI gives None, Colossal None or zeros
            assert zero_grad is None or not zero_grad.any()
            continue
        assert_close(p.grad, zero_grad.view_as(p.grad), rtol=1e-5, atol=1e-6)
        checked += 1
    assert checked == 4
    zero_optimizer.step()
    torch_optimizer.step()
    for p, z1p in zip(torch_model.parameters(), zero_model.parameters(), strict=True):
        assert_close(p.data, z1p.data, rtol=1e-5, atol=1e-6)


def run_dist(rank, world_size, port):
    colossalai.launch(rank=rank, world_size=world_size, host="localhost", port=port, backend="gloo")
    exam_zero_1_torch_ddp(rank)
    exam_zero_1_2(rank)


@rerun_if_address_is_in_use()
def test_zero_1_2():
    spawn(run_dist, 2)


if __name__ == "__main__":
    test_zero_1_2()
    print("zero_optimizer: OK")
