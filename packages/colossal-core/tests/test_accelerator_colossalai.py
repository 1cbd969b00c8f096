"""ColossalAI's BaseAccelerator methods, meaningful on the CPU (and torch.cuda's on a GPU)."""

from __future__ import annotations

import time

import pytest
import torch

from colossal.core.accelerator import BaseAccelerator, CpuAccelerator, get_accelerator
from colossal.core.accelerator import cpu as cpu_module

MIB = 2**20

#: Every method of ColossalAI's BaseAccelerator (colossalai/accelerator/base_accelerator.py).
COLOSSALAI_METHODS = (
    "get_current_device", "current_device", "set_device", "get_device_name", "synchronize",
    "is_available", "device_count", "set_to_device", "get_device_capability",
    "get_device_properties", "utilization", "get_rng_state", "get_rng_state_all",
    "set_rng_state", "set_rng_state_all", "manual_seed", "manual_seed_all", "seed", "seed_all",
    "initial_seed", "empty_cache", "memory_stats", "memory_summary", "memory_snapshot",
    "memory_allocated", "max_memory_allocated", "reset_max_memory_allocated",
    "reset_max_memory_cached", "memory_reserved", "max_memory_reserved",
    "set_per_process_memory_fraction", "reset_peak_memory_stats", "Stream", "Event",
    "current_stream", "default_stream", "set_stream", "stream", "autocast",
)  # fmt: skip


def test_every_colossalai_method_is_there() -> None:
    """Catches: a method of ColossalAI's interface missing (its scripts would fail)."""
    missing = [m for m in COLOSSALAI_METHODS if not callable(getattr(BaseAccelerator, m, None))]
    assert missing == []
    acc = CpuAccelerator()
    assert (acc.name, acc.communication_backend, acc.is_synchronous) == ("cpu", "gloo", True)
    assert acc.current_device() == 0 and acc.get_device_capability() == (0, 0)
    assert acc.get_device_properties().total_memory == acc.total_memory() > 0
    assert 0 <= acc.utilization() <= 100 and acc.is_bf16_supported()
    model = torch.nn.Linear(2, 2)
    assert acc.set_to_device(model) is model and acc.set_to_device([model]) is model


def test_cpu_set_device_accepts_only_the_cpu() -> None:
    """Catches: a CUDA device silently accepted on a CPU job."""
    acc = CpuAccelerator()
    for device in (None, 0, "cpu", torch.device("cpu")):
        acc.set_device(device)
    with pytest.raises(ValueError, match=r"set_device\('cuda:1'\) on the CPU accelerator"):
        acc.set_device("cuda:1")


def test_memory_counters_move_and_reset() -> None:
    """Catches: counters that do not see a 256 MiB tensor, a reset that leaves the old peak,
    reserved/stats figures that disagree with the allocated ones."""
    acc = CpuAccelerator()
    acc.reset_max_memory_allocated()
    before = acc.memory_allocated()
    big = torch.ones(256 * MIB, dtype=torch.uint8)
    during = acc.memory_allocated()
    assert during - before >= 200 * MIB
    assert acc.max_memory_allocated() >= during and acc.max_memory_reserved() >= during
    assert acc.memory_reserved() >= 200 * MIB + before - 16 * MIB
    del big
    peak = acc.max_memory_allocated()
    acc.reset_max_memory_cached()
    assert acc.max_memory_allocated() < peak - 128 * MIB
    stats = acc.memory_stats()
    assert stats["allocated_bytes.all.peak"] >= stats["allocated_bytes.all.current"] > 0
    assert "allocated_bytes.all.peak" in acc.memory_summary() and acc.memory_snapshot() == []


def test_tracked_peak_where_the_kernel_mark_cannot_reset(monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches: a peak that stays at the old high-water mark when clear_refs is refused."""
    acc = CpuAccelerator()
    big = torch.ones(256 * MIB, dtype=torch.uint8)
    del big
    monkeypatch.setattr(cpu_module._Peak, "kernel_resets", False)
    monkeypatch.setattr(cpu_module, "open", _refuse_clear_refs, raising=False)
    acc.reset_peak_memory_stats()
    assert acc.max_memory_allocated() < cpu_module._status_kib("VmHWM") * 1024 - 128 * MIB
    big = torch.ones(256 * MIB, dtype=torch.uint8)
    assert acc.max_memory_allocated() >= acc.memory_allocated() >= 256 * MIB
    del big


def _refuse_clear_refs(path: str, *args: object, **kwargs: object) -> object:
    if "clear_refs" in path:
        raise PermissionError(path)
    return open(path, *args, **kwargs)  # noqa: SIM115 - the real open, returned to the caller


def test_rng_state_round_trip() -> None:
    """Catches: a state that does not restore the generator (the draw after it differs)."""
    acc = CpuAccelerator()
    acc.manual_seed(7)
    assert acc.initial_seed() == 7
    state = acc.get_rng_state()
    first = torch.rand(5)
    acc.set_rng_state(state)
    assert torch.equal(torch.rand(5), first)
    states = acc.get_rng_state_all()
    again = torch.rand(5)
    acc.set_rng_state_all(states)
    assert torch.equal(torch.rand(5), again)
    with pytest.raises(ValueError, match="one state per cpu device"):
        acc.set_rng_state_all([])
    acc.manual_seed_all(7)
    assert torch.equal(torch.rand(5), first)
    acc.seed()
    assert acc.initial_seed() != 7


def test_streams_events_and_autocast() -> None:
    """Catches: stream APIs missing on the CPU, timing events that do not time, autocast
    ignoring its dtype or ``enabled=False``."""
    acc = CpuAccelerator()
    stream = acc.Stream(priority=-1)
    acc.set_stream(stream)
    with acc.stream(stream):
        assert acc.current_stream() is acc.default_stream()
    start, end = acc.Event(enable_timing=True), acc.Event(enable_timing=True)
    start.record()
    time.sleep(0.05)
    end.record()
    end.synchronize()
    assert 40 <= start.elapsed_time(end) <= 5000
    with pytest.raises(RuntimeError, match="enable_timing=True"):
        acc.Event().elapsed_time(end)
    a = torch.ones(4, 4)
    with acc.autocast(dtype=torch.bfloat16):
        assert (a @ a).dtype == torch.bfloat16
    with acc.autocast(enabled=False, dtype=torch.bfloat16):
        assert (a @ a).dtype == torch.float32


def test_memory_fraction_is_validated_and_recorded() -> None:
    """Catches: an impossible fraction accepted, a fraction not read back."""
    acc = CpuAccelerator()
    with pytest.raises(ValueError, match=r"fraction must be in \[0, 1\], got 1.5"):
        acc.set_per_process_memory_fraction(1.5)
    acc.set_per_process_memory_fraction(0.5)
    assert acc.get_per_process_memory_fraction() == 0.5
    acc.set_per_process_memory_fraction(1.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_counters_and_rng() -> None:
    """Catches: the CUDA accelerator not forwarding to torch.cuda (counters, reset, RNG)."""
    acc = get_accelerator("cuda")
    acc.reset_peak_memory_stats()
    before = acc.memory_allocated()
    big = torch.empty(256 * MIB, dtype=torch.uint8, device=acc.get_current_device())
    assert acc.memory_allocated() - before == 256 * MIB
    del big
    acc.reset_max_memory_allocated()
    assert acc.max_memory_allocated() == acc.memory_allocated() == before
    state = acc.get_rng_state()
    first = torch.rand(5, device="cuda")
    acc.set_rng_state(state)
    assert torch.equal(torch.rand(5, device="cuda"), first)
    start, end = acc.Event(enable_timing=True), acc.Event(enable_timing=True)
    start.record()
    torch.ones(1024, 1024, device="cuda").sum()
    end.record()
    acc.synchronize()
    assert start.elapsed_time(end) >= 0
    with acc.autocast(dtype=torch.bfloat16):
        x = torch.ones(4, 4, device="cuda")
        assert (x @ x).dtype == torch.bfloat16
