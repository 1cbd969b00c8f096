"""A first look at colossal-core on CPU: a process-group mesh and a tracked all-reduce.

Run with 4 processes (any world size works; 4 gives a 2 x 2 mesh)::

    python3 -m torch.distributed.run --nproc_per_node 4 examples/core_demo.py
"""

from __future__ import annotations

import argparse

import torch

from colossal.core import DistCoordinator, ProcessGroupMesh, launch_from_torch
from colossal.core.comm import CommTracker, all_gather_object, all_reduce


def _mesh_shape(world_size: int) -> tuple[int, int]:
    tp = 2 if world_size % 2 == 0 else 1
    return world_size // tp, tp


def main() -> None:
    """Build a dp x tp mesh, reduce along each axis under a tracker, print what happened."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 20, help="elements per all-reduce")
    args = parser.parse_args()

    torch.set_num_threads(1)
    launch_from_torch(verbose=False)
    coord = DistCoordinator()
    dp_size, tp_size = _mesh_shape(coord.world_size)
    mesh = ProcessGroupMesh(dp_size, tp_size, axis_names=("dp", "tp"))
    dp_group, tp_group = mesh.get_group_along_axis("dp"), mesh.get_group_along_axis("tp")

    rows = all_gather_object(
        (
            coord.rank,
            mesh.coordinate(),
            mesh.get_ranks_in_group(dp_group),
            mesh.get_ranks_in_group(tp_group),
        )
    )
    coord.print_on_master(f"\n{mesh} on {coord.world_size} CPU processes (gloo)\n")
    coord.print_on_master("| rank | (dp, tp) | dp group | tp group |\n|---:|---|---|---|")
    for rank, xy, dp_ranks, tp_ranks in rows:
        coord.print_on_master(f"| {rank} | {xy} | {dp_ranks} | {tp_ranks} |")

    with CommTracker() as tracker:
        t = torch.full((args.numel,), float(coord.rank))
        all_reduce(t, group=tp_group)
        all_reduce(t, group=dp_group)
    expected = float(sum(range(coord.world_size)))
    ok = bool(torch.all(t == expected))
    results = all_gather_object(ok)
    coord.print_on_master(
        f"\nall-reduce of {args.numel} fp32 elements along tp then dp: every element is "
        f"{t[0].item():g} (expected {expected:g}) on {sum(results)}/{coord.world_size} ranks\n"
    )
    coord.print_on_master("communication recorded on rank 0:\n" + tracker.table())
    coord.block_all()
    if not all(results):
        raise SystemExit("all-reduce gave a wrong result on some rank")


if __name__ == "__main__":
    main()
