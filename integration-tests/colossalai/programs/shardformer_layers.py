"""Shardformer's 1D tensor-parallel linears as ColossalAI's
tests/test_shardformer/test_layer/test_linear_1d.py uses them, on two ranks.

``Linear1D_Col`` / ``Linear1D_Row.from_native_module`` shard an ``nn.Linear`` in place (the
copy's own Parameter objects) and match the unsharded layer in forward, weight gradients
(this rank's chunk) and input gradients; Col -> Row chained is Megatron's MLP and equals the
two plain linears. (ColossalAI's test also round-trips ``state_dict``: Colossal's layers give
their local parts unless ``enable_full_state_dict`` is applied, so that step is left out.)
"""

from copy import deepcopy

import colossalai
import torch
import torch.distributed as dist
import torch.nn as nn
from colossalai.shardformer.layer import Linear1D_Col, Linear1D_Row
from colossalai.tensor.d_tensor import is_distributed_tensor
from colossalai.testing import assert_close, rerun_if_address_is_in_use, spawn


def check_linear_1d_col() -> None:
    linear = nn.Linear(32, 128)
    linear_copy = deepcopy(linear)
    linear_col = Linear1D_Col.from_native_module(
        linear_copy, process_group=None, gather_output=True
    )
    assert is_distributed_tensor(linear_col.weight) and is_distributed_tensor(linear_col.bias)
    assert linear_copy.weight is linear_col.weight and linear_copy.bias is linear_col.bias
    assert linear_col.weight.shape == torch.Size([64, 32])
    assert linear_col.bias.shape == torch.Size([64])

    x = torch.rand(2, 4, 32)
    x_unshard = x.clone().requires_grad_(True)
    x_shard = x.clone().requires_grad_(True)
    out = linear(x_unshard)
    gather_out = linear_col(x_shard)
    assert_close(out, gather_out)
    out.sum().backward()
    gather_out.sum().backward()
    rank = dist.get_rank()
    assert_close(torch.chunk(linear.weight.grad, 2, dim=0)[rank], linear_col.weight.grad)
    assert_close(x_unshard.grad, x_shard.grad)


def check_linear_1d_row() -> None:
    linear = nn.Linear(32, 128)
    linear_copy = deepcopy(linear)
    linear_row = Linear1D_Row.from_native_module(
        linear_copy, process_group=None, parallel_input=False
    )
    assert linear_row.weight.shape == torch.Size([128, 16])
    assert linear_copy.weight is linear_row.weight

    x = torch.rand(2, 4, 32)
    x_unshard = x.clone().requires_grad_(True)
    x_shard = x.clone().requires_grad_(True)
    out = linear(x_unshard)
    row_out = linear_row(x_shard)
    assert_close(out, row_out)
    out.sum().backward()
    row_out.sum().backward()
    rank = dist.get_rank()
    assert_close(torch.chunk(linear.weight.grad, 2, dim=1)[rank], linear_row.weight.grad)
    assert_close(x_unshard.grad, x_shard.grad)


def check_col_then_row() -> None:
    up, down = nn.Linear(32, 64), nn.Linear(64, 32)
    col = Linear1D_Col.from_native_module(deepcopy(up), process_group=None)
    row = Linear1D_Row.from_native_module(deepcopy(down), process_group=None)
    x = torch.rand(3, 32)
    assert_close(down(torch.relu(up(x))), row(torch.relu(col(x))))


def run_dist(rank, world_size, port):
    colossalai.launch(rank=rank, world_size=world_size, host="localhost", port=port, backend="gloo")
    torch.manual_seed(0)  # the same layers and inputs on both ranks
    check_linear_1d_col()
    check_linear_1d_row()
    check_col_then_row()


@rerun_if_address_is_in_use()
def test_linear_1d():
    spawn(run_dist, 2)


if __name__ == "__main__":
    test_linear_1d()
    print("shardformer_layers: OK")
