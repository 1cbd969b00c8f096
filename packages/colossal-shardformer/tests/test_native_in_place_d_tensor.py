"""from_native_module keeps the native Parameter objects; the d_tensor helpers (ColossalAI's).

ColossalAI's Shardformer test asserts ``linear_copy.weight is linear_col.weight`` after
``Linear1D_Col.from_native_module(linear_copy, ...)``: an optimizer built before the swap must
still update the layer. The d_tensor helpers answer ColossalAI's questions about such a
parameter (distributed? sharded? global shape? the whole tensor?).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from colossal.core.testing import distributed_test
from colossal.shardformer.d_tensor import (
    get_global_shape,
    get_sharding_spec,
    is_distributed_tensor,
    is_sharded,
    shard_colwise,
    shard_rowwise,
    sharded_tensor_to_param,
    to_global,
)
from colossal.shardformer.layer import Linear1D_Col, Linear1D_Row


@distributed_test(2)
def test_from_native_module_shards_in_place(rank: int, world_size: int) -> None:
    """Identity kept, local shard the right slice, an earlier optimizer trains the layer.

    Catches: new Parameter objects (ColossalAI's identity assertion fails, an optimizer made
    before the swap updates dead tensors), the wrong rows/columns kept, the placement record
    lost on the native Parameter (checkpoints would save the shard as the whole tensor);
    and the d_tensor helpers' bugs listed in ``_check_d_tensor_helpers``.
    """
    torch.set_num_threads(1)
    torch.manual_seed(0)
    reference = nn.Linear(8, 6)
    col_native = nn.Linear(8, 6)
    col_native.load_state_dict(reference.state_dict())
    weight, bias = col_native.weight, col_native.bias
    optimizer = torch.optim.SGD(col_native.parameters(), lr=0.1)
    col = Linear1D_Col.from_native_module(col_native, None, gather_output=True)
    assert col.weight is weight and col.bias is bias
    assert col_native.weight is col.weight
    lo, hi = 3 * rank, 3 * (rank + 1)
    torch.testing.assert_close(col.weight.data, reference.weight.data[lo:hi], rtol=0, atol=0)
    torch.testing.assert_close(col.bias.data, reference.bias.data[lo:hi], rtol=0, atol=0)
    assert is_distributed_tensor(col.weight) and is_sharded(col.weight)
    assert get_global_shape(col.weight) == torch.Size([6, 8])
    torch.testing.assert_close(to_global(col.weight), reference.weight.data, rtol=0, atol=0)

    # the optimizer built on the native module trains the parallel layer like the plain one
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    col(x).square().sum().backward()
    optimizer.step()
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    reference(x).square().sum().backward()
    reference_optimizer.step()
    torch.testing.assert_close(to_global(col.weight), reference.weight.data, rtol=1e-6, atol=1e-6)

    row_native = nn.Linear(8, 6)
    row_weight, row_bias = row_native.weight, row_native.bias
    full = row_native.weight.detach().clone()
    row = Linear1D_Row.from_native_module(row_native, None, parallel_input=False)
    assert row.weight is row_weight and row.bias is row_bias
    torch.testing.assert_close(row.weight.data, full[:, 4 * rank : 4 * (rank + 1)])
    assert not is_distributed_tensor(row.bias)  # replicated: kept whole, unmarked
    _check_d_tensor_helpers(rank)  # the same two processes (one spawn less)


def _check_d_tensor_helpers(rank: int) -> None:
    """Catches: rowwise/colwise splitting the wrong dim, a replicated tensor called sharded,
    to_global not inverting the split, a Parameter conversion that drops the record."""
    whole = torch.arange(24.0).reshape(4, 6)
    rows = shard_rowwise(whole)
    cols = shard_colwise(whole, dist.group.WORLD)
    torch.testing.assert_close(rows.data, whole[2 * rank : 2 * rank + 2])
    torch.testing.assert_close(cols.data, whole[:, 3 * rank : 3 * rank + 3])
    for part in (rows, cols):
        assert is_sharded(part) and get_global_shape(part) == whole.shape
        torch.testing.assert_close(to_global(part), whole, rtol=0, atol=0)
    with pytest.raises(ValueError, match="shard it first"):
        sharded_tensor_to_param(rows * 1)  # a new tensor: no record of its own
    param = sharded_tensor_to_param(rows)
    assert isinstance(param, nn.Parameter) and get_sharding_spec(param).shape == whole.shape
    plain = torch.ones(3)
    assert not is_distributed_tensor(plain) and not is_sharded(plain)
    assert get_global_shape(plain) == plain.shape
    with pytest.raises(ValueError, match="not distributed"):
        get_sharding_spec(plain)
    with pytest.raises(ValueError, match="does not divide"):
        shard_rowwise(torch.ones(3, 2))
