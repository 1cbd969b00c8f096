"""Model-data bytes per logical memory location, checked against the device's capacity.

Gemini keeps every chunk's storage in one of two *logical* locations: ``"device"`` (the
accelerator) and ``"host"`` (CPU memory, the offload target). On a CPU-only machine the
"device" tensors are CPU tensors too, but they are accounted as device memory, so a device
memory limit (argument or ``COLOSSAL_DEVICE_MEMORY_LIMIT``) makes placement and eviction real
and testable without a GPU. The budget is the single source of truth for how many model-data
bytes each location holds; chunks report every allocation, free and move to it.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from typing import Literal, get_args

from colossal.core.accelerator import get_accelerator

logger = logging.getLogger(__name__)

Location = Literal["device", "host"]
"""A logical memory location: ``"device"`` (the accelerator) or ``"host"`` (CPU offload)."""

LOCATIONS: tuple[Location, ...] = get_args(Location)

DEVICE_MEMORY_LIMIT_ENV = "COLOSSAL_DEVICE_MEMORY_LIMIT"

# Decimal (SI) units are powers of 1000, binary (IEC) units powers of 1024, as their names say.
_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)
_ACCEPTED = (
    "a number of bytes ('1073741824') or a number with a unit: B, KB/MB/GB/TB (powers of 1000) "
    "or KiB/MiB/GiB/TiB (powers of 1024), e.g. '512MB', '1.5GiB'"
)


def parse_memory_size(value: str | int, *, source: str = "value") -> int:
    """Parse a memory size such as ``"512MB"``, ``"1.5GiB"`` or ``"1073741824"`` into bytes.

    Units are case-insensitive; ``KB``/``MB``/``GB``/``TB`` are powers of 1000 and
    ``KiB``/``MiB``/``GiB``/``TiB`` powers of 1024. A fractional result is rounded down.

    Args:
        value: The size: a non-negative ``int`` or a string.
        source: Where the value came from, named in the error message.

    Returns:
        The size in bytes.

    Raises:
        TypeError: ``value`` is neither a string nor an int.
        ValueError: ``value`` is not a size in one of the accepted forms, or is negative.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"{source} must be an int or a string, got {type(value).__name__}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{source} must be >= 0 bytes, got {value}")
        return value
    match = _SIZE_RE.match(value)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"cannot parse {source} {value!r} as a memory size; use {_ACCEPTED}")
    return int(float(match.group(1)) * _UNITS[unit])


def _check_location(location: str) -> None:
    if location not in LOCATIONS:
        raise ValueError(f"unknown memory location {location!r}; use one of {list(LOCATIONS)}")


def _check_nbytes(nbytes: int) -> None:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise TypeError(f"nbytes must be an int, got {type(nbytes).__name__}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")


def _fmt(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{nbytes} B" if unit == "B" else f"{nbytes} B ({value:.2f} {unit})"
        value /= 1024
    return f"{nbytes} B"  # pragma: no cover - loop always returns


class DeviceMemoryExceeded(MemoryError):  # noqa: N818 - the contract name
    """Placing model data on the device would exceed the device memory capacity.

    Attributes:
        what: What was being placed (e.g. ``"chunk 3 payload"``).
        needed: Bytes requested.
        in_use: Device bytes already in use.
        limit: The capacity in bytes (the cap of the placement policy when raised by one).
    """

    def __init__(self, what: str, needed: int, in_use: int, limit: int) -> None:
        self.what = what
        self.needed = needed
        self.in_use = in_use
        self.limit = limit
        super().__init__(
            f"device memory exceeded by {what}: needs {_fmt(needed)} with {_fmt(in_use)} "
            f"already in use, but the limit is {_fmt(limit)} "
            f"(short by {_fmt(in_use + needed - limit)}). Fix: raise the limit (argument or "
            f"{DEVICE_MEMORY_LIMIT_ENV}), offload more (offload_param_frac / "
            f'offload_optim_frac), or use placement_policy="auto"'
        )


class DeviceMemoryBudget:
    """Model-data bytes per logical location, checked against the device capacity.

    Only the ``"device"`` location is limited; ``"host"`` is accounted (used and peak) but
    never refused. All methods are thread-safe.

    Args:
        capacity: Device capacity in bytes (an int, or a string such as ``"2GiB"``). When
            ``None``: the environment variable
            ``COLOSSAL_DEVICE_MEMORY_LIMIT`` (``"512MB"``, ``"1.5GiB"``, ``"1073741824"``),
            else the accelerator's total memory when it is CUDA, else unlimited (``None``).

    Attributes:
        capacity: The device capacity in bytes, or ``None`` for unlimited.

    Raises:
        ValueError: ``capacity`` is negative or the environment variable cannot be parsed.
    """

    def __init__(self, capacity: int | str | None = None) -> None:
        if capacity is not None:
            capacity = parse_memory_size(capacity, source="capacity")
        else:
            capacity = self._default_capacity()
        self.capacity: int | None = capacity
        self._used: dict[str, int] = dict.fromkeys(LOCATIONS, 0)
        self._peak: dict[str, int] = dict.fromkeys(LOCATIONS, 0)
        self._lock = threading.Lock()
        logger.debug("device memory budget: capacity=%s", capacity)

    @staticmethod
    def _default_capacity() -> int | None:
        env = os.environ.get(DEVICE_MEMORY_LIMIT_ENV, "").strip()
        if env:
            return parse_memory_size(env, source=f"environment variable {DEVICE_MEMORY_LIMIT_ENV}")
        accelerator = get_accelerator()
        if accelerator.name == "cuda":
            return accelerator.total_memory()
        return None

    # ---- queries -------------------------------------------------------------------------
    def used(self, location: Location) -> int:
        """Bytes currently held at ``location``."""
        _check_location(location)
        return self._used[location]

    def peak(self, location: Location) -> int:
        """Most bytes held at ``location`` since creation or the last :meth:`reset_peak`."""
        _check_location(location)
        return self._peak[location]

    def available(self, reserve: int = 0) -> int | None:
        """Device bytes still free: ``capacity - used("device") - reserve``.

        Args:
            reserve: Bytes to keep free (e.g. for non-model data). Must be >= 0.

        Returns:
            The free bytes (negative when ``reserve`` exceeds what is free), or ``None`` when
            the capacity is unlimited.
        """
        _check_nbytes(reserve)
        if self.capacity is None:
            return None
        return self.capacity - self._used["device"] - reserve

    def fits(self, nbytes: int, reserve: int = 0) -> bool:
        """Whether ``nbytes`` more on the device would stay within the capacity."""
        _check_nbytes(nbytes)
        free = self.available(reserve)
        return free is None or nbytes <= free

    # ---- updates -------------------------------------------------------------------------
    def allocate(self, location: Location, nbytes: int, what: str) -> None:
        """Account ``nbytes`` newly held at ``location``.

        Args:
            location: ``"device"`` or ``"host"``.
            nbytes: Bytes allocated (>= 0).
            what: Human-readable name of the allocation, used in the error message.

        Raises:
            DeviceMemoryExceeded: The device would hold more than its capacity; nothing is
                accounted then.
        """
        _check_location(location)
        _check_nbytes(nbytes)
        with self._lock:
            self._check_fits(location, nbytes, what)
            self._add(location, nbytes)

    def free(self, location: Location, nbytes: int) -> None:
        """Account ``nbytes`` released from ``location``.

        Raises:
            ValueError: More bytes freed than are in use there (a double free).
        """
        _check_location(location)
        _check_nbytes(nbytes)
        with self._lock:
            self._sub(location, nbytes)

    def move(self, src: Location, dst: Location, nbytes: int, what: str) -> None:
        """Account ``nbytes`` moving from ``src`` to ``dst`` (a no-op when they are equal).

        Raises:
            DeviceMemoryExceeded: ``dst`` is the device and it would exceed its capacity;
                nothing changes then.
            ValueError: ``src`` holds fewer than ``nbytes``.
        """
        _check_location(src)
        _check_location(dst)
        _check_nbytes(nbytes)
        if src == dst:
            return
        with self._lock:
            if self._used[src] < nbytes:
                raise ValueError(
                    f"cannot move {nbytes} B of {what} from {src!r}: only "
                    f"{self._used[src]} B are accounted there"
                )
            self._check_fits(dst, nbytes, what)
            self._used[src] -= nbytes
            self._add(dst, nbytes)

    def reset_peak(self) -> None:
        """Set every location's peak to its current usage."""
        with self._lock:
            self._peak = dict(self._used)

    def as_dict(self) -> dict[str, int | None]:
        """Capacity, usage and peaks as a plain dict (for logs and benchmark rows)."""
        with self._lock:
            out: dict[str, int | None] = {"capacity": self.capacity}
            for loc in LOCATIONS:
                out[f"{loc}_used"] = self._used[loc]
                out[f"{loc}_peak"] = self._peak[loc]
            return out

    def __repr__(self) -> str:
        return (
            f"DeviceMemoryBudget(capacity={self.capacity}, device={self._used['device']}, "
            f"host={self._used['host']})"
        )

    # ---- internals (caller holds the lock) -------------------------------------------------
    def _check_fits(self, location: str, nbytes: int, what: str) -> None:
        if location != "device" or self.capacity is None:
            return
        in_use = self._used["device"]
        if in_use + nbytes > self.capacity:
            raise DeviceMemoryExceeded(what, nbytes, in_use, self.capacity)

    def _add(self, location: str, nbytes: int) -> None:
        self._used[location] += nbytes
        if self._used[location] > self._peak[location]:
            self._peak[location] = self._used[location]

    def _sub(self, location: str, nbytes: int) -> None:
        if self._used[location] < nbytes:
            raise ValueError(
                f"cannot free {nbytes} B at {location!r}: only {self._used[location]} B are "
                "accounted there (freed twice, or freed at the wrong location?)"
            )
        self._used[location] -= nbytes
