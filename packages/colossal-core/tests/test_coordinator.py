"""DistCoordinator: master checks, printing, ordered execution."""

from __future__ import annotations

import os
import time

import torch.distributed as dist

from colossal.core import DistCoordinator, ProcessGroupMesh
from colossal.core.comm import all_gather_object
from colossal.core.testing import distributed_test


@distributed_test(1, 2, 4)
def test_coordinator_identity(rank: int, world_size: int) -> None:
    coord = DistCoordinator()
    assert (coord.rank, coord.world_size, coord.local_rank) == (rank, world_size, rank)
    assert coord.is_master() == (rank == 0)
    assert coord.is_node_master() == (rank == 0)
    assert coord.is_last_process() == (rank == world_size - 1)

    @coord.on_master_only()
    def answer() -> int:
        return 42

    assert answer() == (42 if rank == 0 else None)


@distributed_test(4)
def test_coordinator_with_group(rank: int, world_size: int) -> None:
    mesh = ProcessGroupMesh(2, 2, axis_names=("dp", "tp"))
    tp = mesh.get_group_along_axis("tp")
    coord = DistCoordinator(tp)
    assert coord.is_master() == (rank % 2 == 0)
    assert DistCoordinator().is_master(tp) == (rank % 2 == 0)
    assert coord.is_last_process() == (rank % 2 == 1)


@distributed_test(2, 4)
def test_priority_execution_orders_ranks(rank: int, world_size: int, tmp_path: os.PathLike) -> None:
    marker = os.path.join(tmp_path, "written_by_executor")
    coord = DistCoordinator()
    with coord.priority_execution() as first:
        if first:
            time.sleep(0.5)  # the others must still be waiting
            with open(marker, "w") as fh:
                fh.write("done")
        seen = os.path.exists(marker)
    assert first == (rank == 0)
    assert seen, "a non-executor ran before the executor finished"
    coord.block_all()


@distributed_test(2)
def test_print_on_master(rank: int, world_size: int, tmp_path: os.PathLike) -> None:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        DistCoordinator().print_on_master("hello", rank)
    printed = all_gather_object(buf.getvalue())
    assert printed == ["hello 0\n", ""]
    assert dist.get_world_size() == 2
