"""DistCoordinator and ProcessGroupMesh as ColossalAI's tests/test_cluster use them.

Two ranks: the coordinator's rank and master checks, ``print_on_master``, ``on_master_only``,
``priority_execution`` (rank 0 writes a file first, the other reads it) and ``block_all``;
the mesh's shape, coordinates, ``ravel``/``unravel``, the groups along each axis (their ranks
and an all-reduce over each), ``create_group_along_axis`` with chosen indices.
"""

import os
import tempfile

import colossalai
import torch
import torch.distributed as dist
from colossalai.cluster import DistCoordinator, ProcessGroupMesh
from colossalai.testing import rerun_if_address_is_in_use, spawn


def check_coordinator(tempdir: str) -> None:
    coordinator = DistCoordinator()
    rank = dist.get_rank()
    assert coordinator.rank == rank and coordinator.world_size == 2
    assert coordinator.is_master() == (rank == 0)
    assert coordinator.is_last_process() == (rank == 1)
    coordinator.print_on_master(f"coordinator: master is rank {coordinator.rank}")

    @coordinator.on_master_only()
    def master_value() -> int:
        return 7

    assert master_value() == (7 if rank == 0 else None)
    path = os.path.join(tempdir, "written_by_master.txt")
    with coordinator.priority_execution():
        if coordinator.is_master():
            with open(path, "w") as fh:
                fh.write("first")
        else:  # runs after the master left the block
            with open(path) as fh:
                assert fh.read() == "first"
    coordinator.block_all()


def check_mesh() -> None:
    rank = dist.get_rank()
    # ColossalAI's static helpers: rank <-> coordinate in a (dp, tp) grid of shape (1, 2)
    assert ProcessGroupMesh.unravel(1, (1, 2)) == (0, 1)
    assert ProcessGroupMesh.ravel((0, 1), (1, 2)) == 1
    assert ProcessGroupMesh.unravel(5, (2, 3)) == (1, 2)
    assert ProcessGroupMesh.ravel((1, 2), (2, 3)) == 5

    mesh = ProcessGroupMesh(1, 2)
    assert tuple(mesh.shape) == (1, 2) and mesh.rank == rank
    assert mesh.coordinate() == (0, rank) and mesh.coordinate(1) == rank
    assert mesh.size(0) == 1 and mesh.size(1) == 2
    dp_group = mesh.get_group_along_axis(0)
    tp_group = mesh.get_group_along_axis(1)
    assert mesh.get_ranks_in_group(dp_group) == [rank]
    assert mesh.get_ranks_in_group(tp_group) == [0, 1]
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value, group=tp_group)
    assert value.item() == 3.0
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value, group=dp_group)
    assert value.item() == rank + 1

    # a group over one chosen index of the tp axis: only rank 1 (coordinate 1) is in it
    group = mesh.get_group_along_axis(1, indices_at_axis=[1])
    if rank == 1:
        assert mesh.get_ranks_in_group(group) == [1]
    both = mesh.create_group_along_axis(1, indices_at_axis=[0, 1])
    assert mesh.get_ranks_in_group(both) == [0, 1]

    flipped = ProcessGroupMesh(2, 1)
    assert flipped.coordinate() == (rank, 0)
    assert flipped.get_ranks_in_group(flipped.get_group_along_axis(0)) == [0, 1]


def run_dist(rank, world_size, port, tempdir):
    colossalai.launch(rank=rank, world_size=world_size, host="localhost", port=port, backend="gloo")
    check_coordinator(tempdir)
    check_mesh()


@rerun_if_address_is_in_use()
def test_cluster():
    with tempfile.TemporaryDirectory() as tempdir:
        spawn(run_dist, 2, tempdir=tempdir)


if __name__ == "__main__":
    test_cluster()
    print("cluster: OK")
