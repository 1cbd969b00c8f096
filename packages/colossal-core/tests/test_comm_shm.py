"""Shared-memory collectives: equal to the exact sums, in pieces, in place, and never hang."""

from __future__ import annotations

import glob
import os
import time

import pytest
import torch
import torch.distributed as dist

from colossal.core.comm import all_gather, all_reduce, reduce_scatter, shm
from colossal.core.comm.sharded import _choose
from colossal.core.testing import DistributedTestError, distributed_test, spawn


def _rank_data(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(n, generator=g).to(dtype)


def _exact_sum(world_size: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The sum over ranks as one torch reduction over a stack (fp32 accumulation)."""
    return torch.stack([_rank_data(r, n, dtype) for r in range(world_size)]).sum(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@distributed_test(2, 4)
def test_pieces_match_exact_sums(rank: int, world_size: int, dtype: torch.dtype) -> None:
    # A 256-byte slot forces many pieces and a short last one (the bug: a piece offset).
    ch = shm.ShmChannel(None, tuple(range(world_size)), slot_bytes=256, timeout=60)
    n = 37 * world_size
    data = _rank_data(rank, n, dtype)

    summed = data.clone()
    ch.all_reduce(summed)
    assert torch.equal(summed, _exact_sum(world_size, n, dtype))

    out = torch.empty(n // world_size, dtype=dtype)
    ch.reduce_scatter(out, data.clone())
    mine = slice(rank * (n // world_size), (rank + 1) * (n // world_size))
    assert torch.equal(out, _exact_sum(world_size, n, dtype)[mine])

    gathered = torch.empty(n * world_size, dtype=dtype)
    ch.all_gather(gathered, data)
    want = torch.cat([_rank_data(r, n, dtype) for r in range(world_size)])
    assert torch.equal(gathered, want)


@distributed_test(2, 4)
def test_auto_takes_shm_only_when_synchronous(rank: int, world_size: int) -> None:
    t = torch.zeros(8)
    assert _choose("auto", None, tensor=t, async_op=False) == "shm"
    # An asynchronous call must never block (the caller may run other groups' collectives).
    assert _choose("auto", None, tensor=t, async_op=True) != "shm"
    os.environ["COLOSSAL_SHM_COMM"] = "0"
    assert _choose("auto", None, tensor=t, async_op=False) != "shm"
    del os.environ["COLOSSAL_SHM_COMM"]


@distributed_test(2, 4)
def test_public_ops_in_place_and_no_file_left(rank: int, world_size: int) -> None:
    before = set(glob.glob("/dev/shm/colossal-comm-*"))  # other processes' are not ours
    n = 5
    flat = torch.cat([_rank_data(rank, n, torch.float32) for _ in range(world_size)])
    flat += rank
    want = sum(
        torch.cat([_rank_data(r, n, torch.float32) for _ in range(world_size)]) + r
        for r in range(world_size)
    )
    # reduce-scatter into this rank's own slot of the input (in place)
    out = flat[rank * n : (rank + 1) * n]
    reduce_scatter(out, flat)
    assert torch.allclose(out, want[rank * n : (rank + 1) * n], rtol=1e-6, atol=1e-6)
    # all-gather from this rank's own slot of the output
    full = torch.zeros(n * world_size)
    full[rank * n : (rank + 1) * n] = float(rank)
    all_gather(full, full[rank * n : (rank + 1) * n])
    assert torch.equal(full, torch.arange(world_size).repeat_interleave(n).float())
    x = torch.full((3,), float(rank))
    all_reduce(x)
    assert torch.equal(x, torch.full((3,), float(sum(range(world_size)))))
    dist.barrier()
    assert shm.channel(None, tuple(range(world_size))) is not None
    left = set(glob.glob("/dev/shm/colossal-comm-*")) - before
    assert not left, f"mapped files were left in /dev/shm: {left}"


def test_orphans_of_dead_creators_are_removed() -> None:
    dead = 2**22 + 12345  # above the default pid_max: no such process
    orphan = f"/dev/shm/colossal-comm-{dead}-test"
    live = f"/dev/shm/colossal-comm-{os.getpid()}-test"
    for path in (orphan, live):
        open(path, "wb").close()
    try:
        shm._remove_orphans()
        assert not os.path.exists(orphan), "a dead creator's file was kept"
        assert os.path.exists(live), "a live creator's file was removed"
    finally:
        for path in (orphan, live):
            if os.path.exists(path):
                os.unlink(path)


def _rank_one_skips(rank: int, world_size: int) -> None:
    torch.set_num_threads(1)
    all_reduce(torch.ones(1))  # sets the channel up on both ranks
    if rank == 1:
        time.sleep(20)
        return
    all_reduce(torch.ones(4))


def test_dead_peer_raises_instead_of_hanging() -> None:
    started = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        spawn(_rank_one_skips, 2, comm_timeout=3, timeout=60)
    message = str(info.value)
    assert "rank 0: all_reduce on group [0, 1] failed" in message
    assert "did not arrive" in message
    assert time.monotonic() - started < 20, "rank 0 waited for the sleeper instead of its timeout"


@distributed_test(2, 4)
def test_barrier_and_object_gather(rank: int, world_size: int) -> None:
    from colossal.core.comm import all_gather_object, barrier

    folder = os.path.join("/tmp", f"colossal-shm-barrier-{os.getppid()}")
    os.makedirs(folder, exist_ok=True)
    if rank == world_size - 1:
        time.sleep(0.3)  # the last rank arrives late: a barrier that does not wait shows
    open(os.path.join(folder, f"rank{rank}"), "w").close()
    barrier()
    assert len(os.listdir(folder)) == world_size, "left the barrier before every rank arrived"
    barrier()
    if rank == 0:
        for name in os.listdir(folder):
            os.unlink(os.path.join(folder, name))
        os.rmdir(folder)
    assert all_gather_object({"rank": rank, "pad": "x" * 5000 * rank}) == [
        {"rank": r, "pad": "x" * 5000 * r} for r in range(world_size)
    ]
