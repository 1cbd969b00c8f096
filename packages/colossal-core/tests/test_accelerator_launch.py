"""Accelerator selection, launch argument checking and the launchers' environment handling."""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
import torch

from colossal.core import launch, launch_from_openmpi, launch_from_slurm, launch_from_torch
from colossal.core.accelerator import CpuAccelerator, NoOpStream, get_accelerator


def test_default_is_cpu_here(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLOSSAL_ACCELERATOR", raising=False)
    acc = get_accelerator()
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert acc.name == expected
    if expected == "cpu":
        assert acc.communication_backend == "gloo"
        assert acc.get_current_device() == torch.device("cpu")


def test_env_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLOSSAL_ACCELERATOR", "cpu")
    assert isinstance(get_accelerator(), CpuAccelerator)
    monkeypatch.setenv("COLOSSAL_ACCELERATOR", "tpu")
    with pytest.raises(
        ValueError, match=r"unknown accelerator 'tpu' \(from the environment variable"
    ):
        get_accelerator()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_requested_without_gpu() -> None:
    with pytest.raises(ValueError, match="'cuda'.*not available"):
        get_accelerator("cuda")


def test_cpu_streams_and_memory() -> None:
    acc = CpuAccelerator()
    stream = acc.Stream()
    assert isinstance(stream, NoOpStream)
    with acc.stream(stream) as s:
        assert s is stream
    event = acc.Event()
    event.record()
    assert event.query()
    acc.synchronize()
    before = acc.memory_allocated()
    assert before > 0 and acc.total_memory() >= acc.available_memory() > 0
    acc.reset_peak_memory_stats()
    big = torch.ones(64 * 1024 * 1024, dtype=torch.uint8)  # 64 MiB touched
    assert acc.max_memory_allocated() >= before + 32 * 1024 * 1024
    del big


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rank": 2, "world_size": 2}, r"rank must be an int in \[0, 2\), got 2"),
        ({"rank": 0, "world_size": 0}, "world_size must be a positive int"),
        ({"rank": 0, "world_size": 1, "port": "http"}, "port must be an integer, got 'http'"),
        ({"rank": 0, "world_size": 1, "port": 70000}, "port must be in 1..65535"),
        ({"rank": 0, "world_size": 1, "timeout": -1}, "timeout must be positive"),
    ],
)
def test_launch_rejects_bad_arguments(kwargs: dict, match: str) -> None:
    args = {"host": "127.0.0.1", "port": 29500, **kwargs}
    with pytest.raises(ValueError, match=match):
        launch(**args)


_LAUNCHER_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_PROCID",
    "SLURM_NPROCS",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_SIZE",
)


def _clear_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(
    ("fn", "present", "missing"),
    [
        (launch_from_torch, {"RANK": "0"}, "LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"),
        (launch_from_slurm, {}, "SLURM_PROCID, SLURM_NPROCS"),
        (
            launch_from_openmpi,
            {"OMPI_COMM_WORLD_RANK": "0"},
            "OMPI_COMM_WORLD_LOCAL_RANK, OMPI_COMM_WORLD_SIZE",
        ),
    ],
)
def test_launchers_name_missing_variables(
    monkeypatch: pytest.MonkeyPatch, fn: object, present: dict, missing: str
) -> None:
    _clear_launcher_env(monkeypatch)
    for k, v in present.items():
        monkeypatch.setenv(k, v)
    kwargs = {} if fn is launch_from_torch else {"host": "127.0.0.1", "port": 29500}
    with pytest.raises(RuntimeError, match=f"variable\\(s\\) {missing} not set"):
        fn(**kwargs)  # type: ignore[operator]


def test_launch_from_torch_bad_integer(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {
        "RANK": "zero",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match="RANK='zero' is not an integer"):
        launch_from_torch()


def _seeded_and_relaunched(rank: int, world_size: int) -> list[float]:
    import torch.distributed as dist

    from colossal.core.comm import all_gather_object, broadcast_object
    from colossal.core.testing import free_port

    draws = torch.rand(3).tolist()
    assert all_gather_object(draws) == [draws] * world_size  # same seed on every rank
    port = broadcast_object(free_port() if rank == 0 else None, src=0)
    dist.destroy_process_group()
    # The old group, and its store on the harness's port, live until the process exits.
    with pytest.raises(ValueError, match="was used by an earlier launch in this process"):
        launch_from_torch(seed=7, verbose=False)
    os.environ["MASTER_PORT"] = str(port)
    launch_from_torch(seed=7, verbose=False)  # the harness exported torchrun's variables
    assert dist.get_world_size() == world_size and dist.get_rank() == rank
    with pytest.raises(RuntimeError, match="already initialized"):
        launch_from_torch()
    return draws + torch.rand(1).tolist()


def test_launch_seeds_and_launch_from_torch() -> None:
    from colossal.core.testing import spawn

    results = spawn(_seeded_and_relaunched, 2)
    torch.manual_seed(1024)
    expected = torch.rand(3).tolist()
    torch.manual_seed(7)
    expected += torch.rand(1).tolist()
    assert results == [expected, expected]


@pytest.mark.parametrize(
    ("fn", "env", "expected"),
    [
        (
            launch_from_slurm,
            {"SLURM_PROCID": "5", "SLURM_NPROCS": "8", "SLURM_NTASKS": "99", "SLURM_LOCALID": "1"},
            {"rank": 5, "world_size": 8, "local_rank": 1},
        ),
        (  # SLURM_NTASKS when SLURM_NPROCS is unset; no SLURM_LOCALID: launch picks the device
            launch_from_slurm,
            {"SLURM_PROCID": "3", "SLURM_NTASKS": "4"},
            {"rank": 3, "world_size": 4},
        ),
        (
            launch_from_openmpi,
            {
                "OMPI_COMM_WORLD_RANK": "6",
                "OMPI_COMM_WORLD_SIZE": "16",
                "OMPI_COMM_WORLD_LOCAL_RANK": "2",
            },
            {"rank": 6, "world_size": 16, "local_rank": 2},
        ),
    ],
)
def test_launchers_map_variables_to_launch_arguments(
    monkeypatch: pytest.MonkeyPatch, fn: Any, env: dict[str, str], expected: dict[str, int]
) -> None:
    import sys

    launch_mod = sys.modules["colossal.core.launch"]  # the package re-exports launch() itself
    _clear_launcher_env(monkeypatch)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(launch_mod, "launch", lambda **kwargs: calls.append(kwargs))
    fn("node0", 29511, seed=3, verbose=False)
    assert len(calls) == 1
    got = {k: calls[0][k] for k in ("rank", "world_size", "local_rank") if k in calls[0]}
    assert got == expected
    assert (calls[0]["host"], calls[0]["port"], calls[0]["seed"]) == ("node0", 29511, 3)


def _launch_via(rank: int, world_size: int, launcher: str) -> tuple[int, int, int]:
    import torch.distributed as dist

    from colossal.core import DistCoordinator
    from colossal.core.comm import all_reduce, broadcast_object
    from colossal.core.testing import free_port

    port = broadcast_object(free_port() if rank == 0 else None, src=0)
    dist.destroy_process_group()
    for name in _LAUNCHER_VARIABLES:
        os.environ.pop(name, None)
    if launcher == "slurm":  # one task per node: local id 0 everywhere, world from NTASKS
        os.environ.update(SLURM_PROCID=str(rank), SLURM_NTASKS=str(world_size), SLURM_LOCALID="0")
        launch_from_slurm("127.0.0.1", port, verbose=False)
    else:  # one node: local rank = rank + 0
        os.environ.update(
            OMPI_COMM_WORLD_RANK=str(rank),
            OMPI_COMM_WORLD_SIZE=str(world_size),
            OMPI_COMM_WORLD_LOCAL_RANK=str(rank),
        )
        launch_from_openmpi("127.0.0.1", port, verbose=False)
    t = torch.ones(1)
    all_reduce(t)
    coord = DistCoordinator()
    assert int(t.item()) == world_size
    return dist.get_rank(), dist.get_world_size(), coord.local_rank


@pytest.mark.parametrize("launcher", ["slurm", "openmpi"])
def test_launch_from_slurm_and_openmpi(launcher: str) -> None:
    from colossal.core.testing import spawn

    results = spawn(_launch_via, 2, args=(launcher,))
    local = [0, 0] if launcher == "slurm" else [0, 1]
    assert results == [(0, 2, local[0]), (1, 2, local[1])]


def _draws() -> tuple[list[float], list[float] | None]:
    """Three draws from Python's generator and three from numpy's (None without numpy)."""
    draws = [random.random() for _ in range(3)]
    try:
        import numpy as np
    except ImportError:
        return draws, None
    return draws, np.random.rand(3).tolist()


def _python_and_numpy_draws(seed: int) -> tuple[list[float], list[float] | None]:
    from colossal.core.launch import set_seed

    set_seed(seed)
    return _draws()


def test_set_seed_seeds_python_and_numpy() -> None:
    first = _python_and_numpy_draws(11)
    random.seed(12345)  # disturb every generator in between
    assert _python_and_numpy_draws(11) == first
    assert _python_and_numpy_draws(12) != first
    random.seed(11)
    assert first[0] == [random.random() for _ in range(3)]


def test_set_seed_seeds_numpy_when_installed() -> None:
    np = pytest.importorskip("numpy")
    from colossal.core.launch import set_seed

    set_seed(11)
    a = np.random.rand(4)
    np.random.seed(999)
    set_seed(11)
    assert np.array_equal(a, np.random.rand(4))
    np.random.seed(11)
    assert np.array_equal(a, np.random.rand(4))


def _draws_after_launch(rank: int, world_size: int) -> tuple[list[float], list[float] | None]:
    # The harness ran launch(seed=1024) just before calling this function.
    return _draws()


def test_launch_seeds_python_and_numpy_on_every_rank() -> None:
    from colossal.core.testing import spawn

    results = spawn(_draws_after_launch, 2)
    random.seed(1024)
    expected_py = [random.random() for _ in range(3)]
    assert [r[0] for r in results] == [expected_py, expected_py]
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed(1024)
    expected_np = np.random.rand(3).tolist()
    assert [r[1] for r in results] == [expected_np, expected_np]
