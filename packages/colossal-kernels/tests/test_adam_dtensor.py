"""CPU Adam on DTensor parameters (FSDP2's ``fully_shard`` makes every parameter one)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from colossal.core.testing import distributed_test
from colossal.kernels import CPUAdam, HybridAdam


@distributed_test(2)
def test_cpu_adam_updates_each_ranks_shard_of_a_dtensor(rank: int, world_size: int) -> None:
    """Three steps on a row-sharded DTensor equal the same steps on the whole tensor.

    Catches: the kernel given the DTensor wrapper's pointer and global element count (it
    wrote ``world_size`` times the shard's elements: a segfault or corrupted memory), states
    made as plain tensors (checkpoint IO then cannot gather them: they must stay DTensors
    placed like the parameter), and a gradient reshaped as a DTensor (a gather per step).
    """
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(0)
    full = torch.randn(6, 5, generator=g)
    grads = [torch.randn(6, 5, generator=g) for _ in range(3)]
    ref = torch.nn.Parameter(full.clone())
    ref_opt = CPUAdam([ref], lr=0.1, weight_decay=0.01)
    param = torch.nn.Parameter(distribute_tensor(full.clone(), mesh, [Shard(0)]))
    opt = CPUAdam([param], lr=0.1, weight_decay=0.01)
    for grad in grads:
        ref.grad = grad.clone()
        ref_opt.step()
        param.grad = distribute_tensor(grad.clone(), mesh, [Shard(0)])
        opt.step()
    # 1 ulp apart where a shard's tail runs the scalar path instead of the vector one
    torch.testing.assert_close(param.full_tensor(), ref.detach(), rtol=1e-6, atol=1e-6)
    for key in ("exp_avg", "exp_avg_sq"):
        state = opt.state[param][key]
        assert isinstance(state, DTensor) and state.placements == (Shard(0),), key
        torch.testing.assert_close(state.full_tensor(), ref_opt.state[ref][key], rtol=1e-6,
                                   atol=1e-6)


@distributed_test(2)
def test_nvme_offload_of_a_dtensor_is_refused(rank: int, world_size: int) -> None:
    """Catches: the NVMe layout sized by a DTensor's global element count (a wrong file)."""
    mesh = init_device_mesh("cpu", (world_size,))
    param = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)]))
    opt = HybridAdam([param], lr=0.1, nvme_offload_fraction=1.0)
    param.grad = distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)])
    with pytest.raises(ValueError, match="NVMe offload of a DTensor parameter"):
        opt.step()
