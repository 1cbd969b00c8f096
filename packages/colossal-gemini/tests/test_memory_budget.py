"""DeviceMemoryBudget: capacity sources, the exceeded error, peaks and moves."""

from __future__ import annotations

import pytest

from colossal.gemini import DEVICE_MEMORY_LIMIT_ENV, DeviceMemoryBudget, DeviceMemoryExceeded
from colossal.gemini.memory import parse_memory_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1073741824", 1073741824),
        ("512MB", 512 * 10**6),
        ("512mb", 512 * 10**6),
        ("512 MiB", 512 * 2**20),
        ("1.5GiB", 3 * 2**29),
        ("2GB", 2 * 10**9),
        ("64KiB", 64 * 1024),
        ("100B", 100),
        (" 7 ", 7),
    ],
)
def test_capacity_from_env_spellings(
    monkeypatch: pytest.MonkeyPatch, text: str, expected: int
) -> None:
    # Catches: a unit parsed with the wrong power (MB vs MiB), fractions dropped, case or
    # whitespace sensitivity, the env var ignored.
    monkeypatch.setenv(DEVICE_MEMORY_LIMIT_ENV, text)
    assert DeviceMemoryBudget().capacity == expected
    assert parse_memory_size(text) == expected


@pytest.mark.parametrize("text", ["lots", "12XB", "-5MB", "1.2.3GB", "GB", "5 M B"])
def test_bad_env_value_names_value_and_forms(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    # Catches: a typo in the env var silently meaning "unlimited" (or 0).
    monkeypatch.setenv(DEVICE_MEMORY_LIMIT_ENV, text)
    with pytest.raises(ValueError) as err:
        DeviceMemoryBudget()
    msg = str(err.value)
    assert repr(text) in msg and DEVICE_MEMORY_LIMIT_ENV in msg
    assert "GiB" in msg and "1073741824" in msg


def test_capacity_argument_wins_and_cpu_default_is_unlimited(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Catches: the env var overriding an explicit argument; a CPU run being capped by the
    # machine's RAM (the CPU accelerator's total_memory) instead of unlimited.
    monkeypatch.setenv(DEVICE_MEMORY_LIMIT_ENV, "1KB")
    assert DeviceMemoryBudget(4096).capacity == 4096
    assert DeviceMemoryBudget("2KiB").capacity == 2048
    monkeypatch.delenv(DEVICE_MEMORY_LIMIT_ENV)
    monkeypatch.setenv("COLOSSAL_ACCELERATOR", "cpu")
    budget = DeviceMemoryBudget()
    assert budget.capacity is None and budget.available() is None
    budget.allocate("device", 10**15, "huge")  # unlimited: never refused
    with pytest.raises(ValueError, match="-1"):
        DeviceMemoryBudget(-1)
    with pytest.raises(TypeError):
        DeviceMemoryBudget(1.5)  # type: ignore[arg-type]


def test_exceeding_raises_with_need_in_use_limit_and_fix() -> None:
    # Catches: a silent overrun (allocation accounted past the limit), a message without the
    # numbers, or a failed allocation still being counted.
    budget = DeviceMemoryBudget(1000)
    budget.allocate("device", 600, "chunk 0 payload")
    budget.allocate("host", 10**9, "chunk 1 master")  # host is never limited
    with pytest.raises(DeviceMemoryExceeded) as err:
        budget.allocate("device", 401, "chunk 2 payload")
    exc = err.value
    assert isinstance(exc, MemoryError)
    assert (exc.what, exc.needed, exc.in_use, exc.limit) == ("chunk 2 payload", 401, 600, 1000)
    msg = str(exc)
    parts = ("chunk 2 payload", "401 B", "600 B", "1000 B", DEVICE_MEMORY_LIMIT_ENV,
             "offload_param_frac", "offload_optim_frac", "auto")
    for part in parts:
        assert part in msg
    assert budget.used("device") == 600  # nothing accounted by the failed call
    budget.allocate("device", 400, "exactly fits")  # == capacity is allowed
    assert budget.available() == 0
    assert budget.available(reserve=10) == -10
    assert not budget.fits(1) and budget.fits(0)


def test_peak_tracking_and_reset() -> None:
    # Catches: peak following current usage down, peak not per location, reset zeroing the
    # peak below what is still held.
    budget = DeviceMemoryBudget(None)
    budget.allocate("device", 300, "a")
    budget.allocate("device", 200, "b")
    budget.free("device", 300)
    assert (budget.used("device"), budget.peak("device")) == (200, 500)
    assert budget.peak("host") == 0
    budget.reset_peak()
    assert budget.peak("device") == 200
    budget.allocate("device", 50, "c")
    assert budget.peak("device") == 250
    with pytest.raises(ValueError, match="freed twice"):
        budget.free("device", 1000)
    with pytest.raises(ValueError, match="'gpu'"):
        budget.used("gpu")  # type: ignore[arg-type]


def test_moves_account_both_sides_and_check_the_device() -> None:
    # Catches: a move that only adds at the destination (double counting), an offload that
    # does not free device bytes, a bring-back that bypasses the limit, a failed move that
    # changes the accounting.
    budget = DeviceMemoryBudget(1000)
    budget.allocate("device", 800, "shard")
    budget.move("device", "host", 500, "shard")
    assert (budget.used("device"), budget.used("host")) == (300, 500)
    assert budget.peak("device") == 800 and budget.peak("host") == 500
    budget.allocate("device", 600, "payload")
    with pytest.raises(DeviceMemoryExceeded, match="bring back"):
        budget.move("host", "device", 200, "bring back")
    assert (budget.used("device"), budget.used("host")) == (900, 500)
    budget.move("host", "device", 100, "bring back")
    assert (budget.used("device"), budget.used("host")) == (1000, 400)
    budget.move("host", "host", 10**9, "no-op")  # same location: nothing happens
    with pytest.raises(ValueError, match="only 400 B"):
        budget.move("host", "device", 401, "too much")
    assert budget.as_dict() == {
        "capacity": 1000, "device_used": 1000, "device_peak": 1000,
        "host_used": 400, "host_peak": 500,
    }
