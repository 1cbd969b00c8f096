"""DistCoordinator: master checks, printing, ordered execution."""

from __future__ import annotations

import os
import time

import pytest
import torch.distributed as dist

from colossal.core import DistCoordinator, ProcessGroupMesh, launch
from colossal.core.comm import all_gather_object, broadcast_object
from colossal.core.launch import get_local_rank
from colossal.core.testing import DistributedTestError, distributed_test, free_port, spawn


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


_LOCAL_RANK_VARS = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK")


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"SLURM_LOCALID": "3"}, 3),
        ({"OMPI_COMM_WORLD_LOCAL_RANK": "2"}, 2),
        ({"SLURM_LOCALID": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "2"}, 3),
        ({"LOCAL_RANK": "1", "SLURM_LOCALID": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "2"}, 1),
    ],
)
def test_local_rank_lookup_order(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], expected: int | None
) -> None:
    for name in _LOCAL_RANK_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert get_local_rank() == expected


def test_local_rank_bad_value(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _LOCAL_RANK_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_LOCALID", "first")
    with pytest.raises(ValueError, match="SLURM_LOCALID='first' is not an integer"):
        get_local_rank()


def _relaunch(rank: int, world_size: int, env: dict[str, str], **launch_kwargs: int) -> None:
    """Tear down the harness's group and launch again with only ``env`` describing the job."""
    port = broadcast_object(free_port() if rank == 0 else None, src=0)
    dist.destroy_process_group()
    for name in ("RANK", "WORLD_SIZE", *_LOCAL_RANK_VARS):
        os.environ.pop(name, None)
    os.environ.update(env)
    launch(rank, world_size, "127.0.0.1", port, verbose=False, **launch_kwargs)


@distributed_test(2)
def test_local_rank_from_slurm_variable(rank: int, world_size: int) -> None:
    # Two "nodes" with one task each: SLURM_LOCALID is 0 on both, LOCAL_RANK is unset.
    _relaunch(rank, world_size, {"SLURM_LOCALID": "0"})
    coord = DistCoordinator()
    assert (coord.rank, coord.local_rank) == (rank, 0)
    assert coord.is_node_master()


@distributed_test(2)
def test_local_rank_given_to_launch_wins(rank: int, world_size: int) -> None:
    _relaunch(rank, world_size, {"LOCAL_RANK": "9"}, local_rank=rank + 5)
    assert DistCoordinator().local_rank == rank + 5
    assert not DistCoordinator().is_node_master()


def _master_raises(rank: int, world_size: int) -> None:
    with DistCoordinator().priority_execution() as first:
        if first:
            raise ValueError("planted failure in the executor's body")
    all_gather_object(rank)  # the others go on to their next collective


def test_priority_execution_raising_master_fails_fast() -> None:
    # The collective timeout (1 h) is far beyond the run's timeout (120 s, which only stops a
    # hang): waiting for the others' collective would be reported as a timeout instead.
    with pytest.raises(DistributedTestError) as info:
        spawn(_master_raises, 2, comm_timeout=3600, timeout=120)
    message = str(info.value)
    assert message.startswith("rank 0 of 2 failed in _master_raises"), message
    assert "ValueError: planted failure in the executor's body" in message
    assert "timed out" not in message


def _master_raises_others_proceed(rank: int, world_size: int, directory: str) -> str:
    passed = os.path.join(directory, f"rank{rank}_passed")
    try:
        with DistCoordinator().priority_execution() as first:
            if first:
                raise ValueError("planted")
    except ValueError:
        assert rank == 0, "only the executor's body raised"
        # The error surfaced on the executor; the others must get past the barrier while the
        # executor waits here, outside any collective.
        others = [os.path.join(directory, f"rank{r}_passed") for r in range(1, world_size)]
        while not all(os.path.exists(p) for p in others):
            time.sleep(0.05)
        return "raised"
    assert rank != 0, "the executor's error was swallowed"
    with open(passed, "w") as fh:
        fh.write("ok")
    return "passed"


def test_priority_execution_raising_master_releases_the_others(tmp_path: os.PathLike) -> None:
    # Without the barrier in a finally, rank 1 waits in it for ever while rank 0 waits for
    # rank 1's file: the run's timeout (120 s, far below the 1 h collective timeout) stops
    # that hang and reports it.
    results = spawn(
        _master_raises_others_proceed, 2, args=(str(tmp_path),), comm_timeout=3600, timeout=120
    )
    assert results == ["raised", "passed"]
