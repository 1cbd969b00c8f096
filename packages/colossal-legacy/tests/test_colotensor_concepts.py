"""The seeds' "ColoTensor Concepts" page at world 4, the ProcessGroup layout, and bad input.

Catches: a ProcessGroup that puts tp on strided instead of consecutive ranks (the seeds' rule:
tp inner, dp outer), wrong tp/dp local ranks or groups, a from_torch_tensor that treats the
payload as the whole tensor (global shape (2, 3, 1) instead of (2, 3, 2)), a to_replicate that
does not gather along the last dim or set_dist_spec that takes the wrong rows, and specs that
accept num_partitions != tp_degree or tp * dp != world silently.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from colossal.core.testing import distributed_test
from colossal.legacy.tensor import (
    ColoTensor,
    ColoTensorSpec,
    ComputePattern,
    ComputeSpec,
    ProcessGroup,
    ReplicaSpec,
    ShardSpec,
)


def _concepts_example(rank: int) -> None:
    """The page's program: a (2, 3, 1) payload per rank, split on the last dim over tp 2."""
    pg = ProcessGroup(tp_degree=2, dp_degree=2)
    torch.manual_seed(0)
    local_tensor = torch.randn(2, 3, 1)
    spec = ColoTensorSpec(
        pg,
        ShardSpec(dims=[-1], num_partitions=[pg.tp_world_size()]),
        ComputeSpec(ComputePattern.TP1D),
    )
    t1 = ColoTensor.from_torch_tensor(local_tensor, spec)
    assert t1.shape == (2, 3, 2) and t1.is_sharded() and t1.has_compute_spec()
    assert torch.equal(t1.to_local(), local_tensor)
    # every rank drew the same payload, so the global tensor is it twice along the last dim
    whole = torch.cat([local_tensor, local_tensor], dim=-1)
    t1 = t1.to_replicate()
    assert isinstance(t1, ColoTensor) and t1.is_replicate()
    assert torch.equal(t1.to_local(), whole)
    t1.set_dist_spec(ShardSpec([0], [pg.tp_world_size()]))
    assert t1.is_shard_1drow() and t1.shape == (2, 3, 2)
    assert torch.equal(t1.to_local(), whole[pg.tp_local_rank() : pg.tp_local_rank() + 1])


def _layout(rank: int) -> None:
    """tp 2 x dp 2 and tp 4 against the seeds' rule (tp groups are consecutive ranks)."""
    pg = ProcessGroup(tp_degree=2, dp_degree=2)
    assert (pg.tp_world_size(), pg.dp_world_size(), pg.rank()) == (2, 2, rank)
    assert (pg.tp_local_rank(), pg.dp_local_rank()) == (rank % 2, rank // 2)
    assert pg.tp_rank_list() == [rank // 2 * 2, rank // 2 * 2 + 1]
    assert pg.dp_rank_list() == [rank % 2, rank % 2 + 2]
    assert dist.get_process_group_ranks(pg.tp_process_group()) == pg.tp_rank_list()
    assert dist.get_process_group_ranks(pg.dp_process_group()) == pg.dp_rank_list()
    tp4 = ProcessGroup(tp_degree=4)
    assert (tp4.dp_world_size(), tp4.tp_local_rank(), tp4.dp_local_rank()) == (1, rank, 0)
    assert dist.get_process_group_ranks(tp4.tp_process_group()) == [0, 1, 2, 3]
    assert dist.get_process_group_ranks(tp4.dp_process_group()) == [rank]
    default = ProcessGroup()
    assert (default.tp_world_size(), default.dp_world_size()) == (1, 4)
    assert ProcessGroup(dp_degree=2).tp_world_size() == 2
    assert ProcessGroup(tp_degree=2, dp_degree=2).mesh is pg.mesh  # cached: no new groups


def _bad_input(rank: int) -> None:
    """Each bad argument is refused with the values and the fix."""
    with pytest.raises(ValueError, match=r"tp_degree \(2\) x dp_degree \(3\) = 6 .* \(4\)"):
        ProcessGroup(tp_degree=2, dp_degree=3)
    with pytest.raises(ValueError, match=r"tp_degree \(3\) x dp_degree \(1\)"):
        ProcessGroup(tp_degree=3)
    with pytest.raises(ValueError, match=r"ranks \[0, 1\] must be every rank .*ranks=None"):
        ProcessGroup(rank=0, ranks=[0, 1], tp_degree=2)
    pg = ProcessGroup(tp_degree=2, dp_degree=2)
    bad = ColoTensorSpec(pg, ShardSpec([0], [4]))
    with pytest.raises(ValueError, match=r"num_partitions=4 .* tp_degree \(2\).*pg.tp_world_size"):
        ColoTensor.from_torch_tensor(torch.zeros(4, 2), bad)
    t = ColoTensor.from_torch_tensor(torch.zeros(4, 2), ColoTensorSpec(pg))
    with pytest.raises(ValueError, match="num_partitions=3"):
        t.set_dist_spec(ShardSpec([0], [3]))
    with pytest.raises(ValueError, match="dim 2 is out of range"):
        t.set_dist_spec(ShardSpec([2], [2]))
    t.set_dist_spec(ShardSpec([0], [2]))
    with pytest.raises(ValueError, match=r"set_dist_spec\(ReplicaSpec\(\)\) first"):
        t.set_process_group(ProcessGroup(tp_degree=4))
    with pytest.raises(ValueError, match="parts along dim 0 have sizes"):  # 3 and 1 rows: not 2/2
        ColoTensor.from_torch_tensor(torch.zeros(3 if rank % 2 == 0 else 1, 2), bad_split(pg))


def bad_split(pg: ProcessGroup) -> ColoTensorSpec:
    """A row split over tp."""
    return ColoTensorSpec(pg, ShardSpec([0], [pg.tp_world_size()]))


@distributed_test(4)
def test_colotensor_concepts_world4(rank: int, world_size: int) -> None:
    """The page's example, the rank layout and bad input at world 4 (one spawn for all three).

    Catches: see the module docstring.
    """
    torch.set_num_threads(1)
    _concepts_example(rank)
    _layout(rank)
    _bad_input(rank)


def test_spec_arguments_are_checked() -> None:
    """Catches: ShardSpec over two dims, ComputeSpec without a ComputePattern, ProcessGroup
    before torch.distributed is up (each would fail later, far from the mistake)."""
    with pytest.raises(ValueError, match=r"dims=\[0, 1\].*ShardSpec\(\[-1\]"):
        ShardSpec([0, 1], [2, 2])
    with pytest.raises(TypeError, match="ComputePattern.TP1D"):
        ComputeSpec("TP1D")  # type: ignore[arg-type]
    assert ShardSpec([0], [2]) == ShardSpec([0], [2]) != ReplicaSpec()
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="colossalai.launch"):
            ProcessGroup()
