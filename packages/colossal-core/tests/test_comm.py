"""Communication helpers: results equal torch's, and the tracker counts calls and bytes."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from colossal.core import ProcessGroupMesh
from colossal.core.comm import (
    CommTracker,
    P2POp,
    all_gather,
    all_gather_object,
    all_reduce,
    all_to_all,
    batch_isend_irecv,
    broadcast,
    broadcast_object,
    irecv,
    isend,
    recv,
    reduce,
    reduce_scatter,
    send,
)
from colossal.core.testing import distributed_test


@pytest.mark.parametrize("algorithm", ["native", "all_reduce", "rooted", "auto"])
@distributed_test(1, 2, 4)
def test_collectives_values_and_bytes(rank: int, world_size: int, algorithm: str) -> None:
    world = tuple(range(world_size))
    n = 6
    with CommTracker() as tracker:
        t = torch.full((n,), float(rank + 1))
        all_reduce(t)
        assert torch.equal(t, torch.full((n,), world_size * (world_size + 1) / 2))

        full = torch.arange(n * world_size, dtype=torch.float32) + rank
        out = torch.empty(n)
        reduce_scatter(out, full, algorithm=algorithm)
        expected = world_size * torch.arange(rank * n, (rank + 1) * n, dtype=torch.float32) + sum(
            range(world_size)
        )
        assert torch.equal(out, expected)

        mine = torch.full((n,), float(rank), dtype=torch.bfloat16)
        gathered = torch.empty(n * world_size, dtype=torch.bfloat16)
        all_gather(gathered, mine, algorithm=algorithm)
        assert torch.equal(
            gathered, torch.arange(world_size).repeat_interleave(n).to(torch.bfloat16)
        )

        b = torch.full((3,), float(rank), dtype=torch.float64)
        broadcast(b, src=world_size - 1)
        assert torch.equal(b, torch.full((3,), float(world_size - 1), dtype=torch.float64))

        r = torch.ones(2, dtype=torch.int64)
        reduce(r, dst=0)
        if rank == 0:
            assert torch.equal(r, torch.full((2,), world_size))

        send_buf = torch.arange(world_size * 2, dtype=torch.float32) + 100 * rank
        recv_buf = torch.empty(world_size * 2)
        all_to_all(recv_buf, send_buf)
        expected_a2a = torch.cat(
            [torch.arange(2 * rank, 2 * rank + 2) + 100.0 * src for src in range(world_size)]
        )
        assert torch.equal(recv_buf, expected_a2a)

        objs = all_gather_object({"rank": rank})
        assert objs == [{"rank": r} for r in range(world_size)]
        assert broadcast_object("hello" if rank == 0 else None, src=0) == "hello"

    assert tracker.calls("all_reduce", world) == 1 and tracker.bytes("all_reduce", world) == n * 4
    assert tracker.bytes("reduce_scatter") == n * world_size * 4
    assert tracker.bytes("all_gather") == n * world_size * 2  # bf16, full gathered size
    assert tracker.bytes("broadcast") == 3 * 8
    assert tracker.bytes("reduce") == 2 * 8
    assert tracker.bytes("all_to_all") == world_size * 2 * 4
    assert tracker.calls("all_gather_object") == 1
    assert tracker.calls() == 8
    summary = tracker.summary()
    assert summary["all_reduce"][world].calls == 1
    assert "| all_reduce | " in tracker.table()


@distributed_test(2, 4)
def test_all_gather_object_small_and_large_pickles(rank: int, world_size: int) -> None:
    """Catches a slot that truncates or mixes payloads, lengths read from the wrong rank, and
    a second round entered by some ranks only (it would hang or mismatch)."""
    from colossal.core.comm.ops import INLINE_OBJECT_BYTES

    def make(case: int, r: int) -> object:
        """Rank ``r``'s object in ``case``."""
        return [
            None,
            b"",
            {"rank": r, "pieces": [(f"f{r}", i, i * 3) for i in range(r + 1)]},
            bytes(range(256)) * (INLINE_OBJECT_BYTES // 256),  # close to the slot's size
            b"x" * (INLINE_OBJECT_BYTES * 3 + r) if r == world_size - 1 else r,  # two rounds
        ][case]

    for case in range(5):
        assert all_gather_object(make(case, rank)) == [make(case, r) for r in range(world_size)]


@distributed_test(2, 4)
def test_point_to_point_and_batch(rank: int, world_size: int) -> None:
    nxt, prv = (rank + 1) % world_size, (rank - 1) % world_size
    with CommTracker() as tracker:
        # Blocking ring: even ranks send first so no pair deadlocks.
        out = torch.full((5,), float(rank))
        got = torch.empty(5)
        if rank % 2 == 0:
            send(out, nxt)
            recv(got, prv)
        else:
            recv(got, prv)
            send(out, nxt)
        assert torch.equal(got, torch.full((5,), float(prv)))

        got2 = torch.empty(4, dtype=torch.float16)
        works = batch_isend_irecv(
            [
                P2POp("send", torch.full((4,), float(rank), dtype=torch.float16), nxt),
                P2POp("recv", got2, prv),
            ]
        )
        for w in works:
            w.wait()
        assert torch.equal(got2, torch.full((4,), float(prv), dtype=torch.float16))

        got3 = torch.empty(3)
        handles = [isend(torch.full((3,), 7.0 + rank), nxt), irecv(got3, prv)]
        for h in handles:
            h.wait()
        assert torch.equal(got3, torch.full((3,), 7.0 + prv))
    assert tracker.calls("send") == 3 and tracker.calls("recv") == 3
    assert tracker.bytes("send") == 5 * 4 + 4 * 2 + 3 * 4
    assert tracker.bytes("recv") == tracker.bytes("send")


@distributed_test(4)
def test_tracker_separates_groups_and_nests(rank: int, world_size: int) -> None:
    mesh = ProcessGroupMesh(2, 2, axis_names=("dp", "tp"))
    dp, tp = mesh.get_group_along_axis("dp"), mesh.get_group_along_axis("tp")
    dp_key, tp_key = tuple(mesh.get_ranks_in_group(dp)), tuple(mesh.get_ranks_in_group(tp))
    with CommTracker() as outer:
        all_reduce(torch.ones(10), group=dp)
        with CommTracker() as inner:
            all_reduce(torch.ones(3, dtype=torch.float16), group=tp)
            all_reduce(torch.ones(3, dtype=torch.float16), group=tp)
    all_reduce(torch.ones(1))  # after both trackers closed: not counted
    assert outer.bytes("all_reduce", dp_key) == 40 and outer.bytes("all_reduce", tp_key) == 12
    assert inner.calls() == 2 and inner.calls(group=dp_key) == 0
    assert outer.calls() == 3
    outer.reset()
    assert outer.calls() == 0


@distributed_test(2)
def test_size_mismatch_is_a_clear_error(rank: int, world_size: int) -> None:
    with pytest.raises(ValueError, match="needs 2 x output"):
        reduce_scatter(torch.empty(3), torch.empty(5))
    with pytest.raises(ValueError, match="pad the inputs"):
        all_gather(torch.empty(5), torch.empty(3))
    with pytest.raises(ValueError, match="'send' or 'recv'"):
        P2POp("sendrecv", torch.empty(1), 0)
    assert dist.get_world_size() == 2


def test_helpers_need_initialized_dist() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="launch"):
        all_reduce(torch.ones(1))


@pytest.mark.parametrize("algorithm", ["native", "all_reduce", "rooted"])
@distributed_test(2, 4)
def test_async_and_in_place_gather(rank: int, world_size: int, algorithm: str) -> None:
    n = 5
    # ZeRO-style: the local shard is a view into the gathered buffer at this rank's slot.
    flat = torch.full((n * world_size,), -1.0)
    shard = flat[rank * n : (rank + 1) * n]
    shard.copy_(torch.arange(n, dtype=torch.float32) + 10 * rank)
    work = all_gather(flat, shard, async_op=True, algorithm=algorithm)
    assert work is not None
    work.wait()
    expected = torch.cat([torch.arange(n, dtype=torch.float32) + 10 * r for r in range(world_size)])
    assert torch.equal(flat, expected)
    # Shard overlapping the output somewhere else than its own slot is still right.
    other = torch.zeros(n * world_size)
    other[:n] = float(rank + 1)
    all_gather(other, other[:n], algorithm=algorithm)
    assert torch.equal(other, torch.arange(1, world_size + 1).repeat_interleave(n).float())
    grads = torch.ones(n * world_size) * (rank + 1)
    out = torch.empty(n)
    work = reduce_scatter(out, grads, async_op=True, algorithm=algorithm)
    assert work is not None
    work.wait()
    assert torch.equal(out, torch.full((n,), float(sum(range(1, world_size + 1)))))
    with pytest.raises(ValueError, match="algorithm must be one of"):
        all_gather(flat, shard, algorithm="bogus")


@distributed_test(2, 4)
def test_ring_reduce_scatter_sums_every_rank_into_its_slice(rank: int, world_size: int) -> None:
    """Catches a slice index off by one step (a rank ends with another's slice or a partial
    sum of fewer ranks), a lost or doubled contribution, and a reused scratch buffer."""
    n = 7
    gen = torch.Generator().manual_seed(100 + rank)
    mine = torch.randn(n * world_size, generator=gen, dtype=torch.float64)
    everyone = [torch.randn(n * world_size, generator=torch.Generator().manual_seed(100 + r),
                            dtype=torch.float64) for r in range(world_size)]
    expected = torch.stack(everyone).sum(0)[rank * n : (rank + 1) * n]
    for async_op in (False, True):
        out = torch.empty(n, dtype=torch.float64)
        work = reduce_scatter(out, mine.clone(), async_op=async_op, algorithm="ring")
        if async_op:
            assert work is not None
            work.wait()
        torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    inside = mine.clone()  # the output a view of the input at this rank's slot: in place
    reduce_scatter(inside[rank * n : (rank + 1) * n], inside, algorithm="ring")
    torch.testing.assert_close(inside[rank * n : (rank + 1) * n], expected, rtol=1e-12,
                               atol=1e-12)
    out = torch.empty(n, dtype=torch.float64)
    reduce_scatter(out, mine.clone())  # auto on gloo sums around the ring
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="only sums"):
        reduce_scatter(out, mine.clone(), op=dist.ReduceOp.MAX, algorithm="ring")
    with pytest.raises(ValueError, match="only reduce-scatters"):
        all_gather(mine, mine[:n], algorithm="ring")


@distributed_test(2)
def test_async_ring_reduce_scatter_reports_completion_to_polls(rank: int, world_size: int) -> None:
    """Gloo's point-to-point works say ``is_completed() == False`` until waited on: a poller
    (Gemini's backward walk frees a chunk's gradient buffer only when its reduction polls
    complete) held every buffer until the end of backward. Catches a poll that never turns
    true, and a ``wait`` after polls that waits on the gloo works a second time (it hangs)."""
    n = 5
    expected = torch.full((n,), float(sum(range(1, world_size + 1))))
    out = torch.empty(n)
    work = reduce_scatter(out, torch.full((n * world_size,), float(rank + 1)), async_op=True,
                          algorithm="ring")
    assert work is not None
    all_reduce(torch.ones(1))  # both ranks have launched the exchange
    polled = False
    for _ in range(30_000):  # a hang guard (up to 30 s), not a speed limit
        polled = work.is_completed()
        if polled:
            break
        time.sleep(0.001)
    assert polled, "the ring reduce-scatter never reported completion to a poller"
    work.wait()
    assert torch.equal(out, expected)
    assert work.is_completed()
