"""The test harness itself: results come back, failures are fast and carry the traceback."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from colossal.core.comm import CommError, all_reduce
from colossal.core.testing import DistributedTestError, distributed_test, spawn


def _rank_and_env(rank: int, world_size: int, offset: int) -> tuple[int, int, str, int]:
    t = torch.tensor([float(rank)])
    all_reduce(t)
    return rank + offset, world_size, os.environ["MASTER_ADDR"], int(t.item())


def test_spawn_returns_values_in_rank_order() -> None:
    values = spawn(_rank_and_env, 3, args=(10,))
    assert values == [(10, 3, "127.0.0.1", 3), (11, 3, "127.0.0.1", 3), (12, 3, "127.0.0.1", 3)]


def _raise_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("planted failure on rank one")
    all_reduce(torch.ones(1))  # rank 0 waits here for a peer that never comes
    raise AssertionError("rank 0's collective returned without its peer")


def test_raising_rank_fails_fast_with_traceback() -> None:
    # The collective timeout (1 h) is far beyond the run's timeout (120 s, which only stops a
    # hang): a harness that waited for rank 0's collective would report its own timeout, or
    # rank 0's collective error, instead of rank 1's traceback.
    with pytest.raises(DistributedTestError) as info:
        spawn(_raise_on_rank_one, 2, comm_timeout=3600, timeout=120)
    message = str(info.value)
    assert message.startswith("rank 1 of 2 failed in _raise_on_rank_one"), message
    assert "ValueError: planted failure on rank one" in message
    assert "timed out" not in message


def _die_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(7)
    all_reduce(torch.ones(1))


def test_dead_rank_is_reported() -> None:
    with pytest.raises(DistributedTestError) as info:
        spawn(_die_on_rank_one, 2, comm_timeout=120)
    message = str(info.value)
    # Either the harness saw rank 1 die, or rank 0 noticed its peer vanish first.
    assert "rank 1 of 2 died (exit code 7)" in message or "rank 0 of 2 failed" in message


def _skip_collective(rank: int, world_size: int) -> None:
    if rank == 1:
        time.sleep(30)
        return
    all_reduce(torch.ones(1))


def test_collective_timeout_names_rank_and_collective() -> None:
    with pytest.raises(DistributedTestError) as info:
        spawn(_skip_collective, 2, comm_timeout=3, timeout=60)
    message = str(info.value)
    assert "rank 0 of 2 failed" in message
    assert "CommError" in message and "rank 0: all_reduce on group [0, 1] failed" in message


def _sleep_forever(rank: int, world_size: int) -> None:
    time.sleep(600)


def test_hung_run_times_out() -> None:
    with pytest.raises(DistributedTestError, match=r"timed out after 5 s .* ranks \[0\]"):
        spawn(_sleep_forever, 1, timeout=5)


def test_bad_world_size() -> None:
    with pytest.raises(ValueError, match="world_size"):
        spawn(_sleep_forever, 0)


@pytest.mark.parametrize("scale", [2.0, 3.0])
@distributed_test(1, 2)
def test_decorator_forwards_params(rank: int, world_size: int, scale: float) -> None:
    t = torch.tensor([scale])
    all_reduce(t)
    assert t.item() == scale * world_size
    assert dist.get_world_size() == world_size


def test_comm_error_is_runtime_error() -> None:
    assert issubclass(CommError, RuntimeError)


def test_port_in_use_is_retried_on_another_port(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket
    import sys

    spawn_mod = sys.modules["colossal.core.testing.spawn"]  # the package re-exports spawn()
    real_free_port = spawn_mod.free_port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(8)  # rank 0's rendezvous store cannot listen on this port
        busy = taken.getsockname()[1]
        ports: list[int] = []

        def first_busy_then_free() -> int:
            ports.append(busy if not ports else real_free_port())
            return ports[-1]

        monkeypatch.setattr(spawn_mod, "free_port", first_busy_then_free)
        values = spawn(_rank_and_env, 2, args=(0,), timeout=120)
    assert values == [(0, 2, "127.0.0.1", 1), (1, 2, "127.0.0.1", 1)]
    assert len(ports) == 2 and ports[0] == busy and ports[1] != busy
