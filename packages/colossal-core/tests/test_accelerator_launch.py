"""Accelerator selection, launch argument checking and the launchers' environment handling."""

from __future__ import annotations

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
    for name in (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "SLURM_PROCID",
        "SLURM_NPROCS",
        "SLURM_NTASKS",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_SIZE",
    ):
        monkeypatch.delenv(name, raising=False)
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

    from colossal.core.comm import all_gather_object

    draws = torch.rand(3).tolist()
    assert all_gather_object(draws) == [draws] * world_size  # same seed on every rank
    dist.destroy_process_group()
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
