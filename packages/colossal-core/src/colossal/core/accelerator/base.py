"""The device abstraction every Colossal package programs against."""

from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import Protocol, TypeVar

import torch
from torch import nn

_T = TypeVar("_T")


class DeviceStream(Protocol):
    """What Colossal uses of a device stream: ``torch.cuda.Stream`` or :class:`NoOpStream`."""

    def synchronize(self) -> None:
        """Wait for the work queued on the stream."""

    def query(self) -> bool:
        """Whether all work queued on the stream is complete."""


class DeviceEvent(Protocol):
    """What Colossal uses of a device event: ``torch.cuda.Event`` or :class:`NoOpEvent`."""

    def synchronize(self) -> None:
        """Wait for the recorded work."""

    def query(self) -> bool:
        """Whether the recorded work is complete."""


_ModuleT = TypeVar("_ModuleT", bound=nn.Module)
DeviceLike = torch.device | int | str | None
"""A device argument: a ``torch.device``, an index, a device string, or None (the current)."""


class BaseAccelerator(ABC):
    """A compute device family (CPU, CUDA) behind one small interface.

    Code elsewhere in Colossal never names a device type directly; it asks the accelerator for
    the current device, the communication backend, streams and memory figures. Every method
    of ColossalAI's ``BaseAccelerator`` is here with its signature (device APIs, random
    number generators, memory counters, streams and events, autocast), meaningful on the CPU
    too: memory from the process, the RNG of torch's CPU generator, streams that run nothing
    asynchronously. The ``device`` arguments default to the current device.

    Attributes:
        name: Short device type name (``"cpu"``, ``"cuda"``).
        communication_backend: The ``torch.distributed`` backend that suits this device.
        is_synchronous: Whether work finishes before the call that queued it returns.
    """

    name: str = ""
    communication_backend: str = ""
    is_synchronous: bool = False

    # ---- device -------------------------------------------------------------------------
    @abstractmethod
    def is_available(self) -> bool:
        """Whether this accelerator can be used in this process."""

    @abstractmethod
    def device_count(self) -> int:
        """Number of devices of this kind visible to the process."""

    @abstractmethod
    def get_current_device(self) -> torch.device:
        """The device new tensors of this process should live on."""

    @abstractmethod
    def set_device(self, device: DeviceLike = None) -> None:
        """Make ``device`` (an index or device) current for this process (CPU: only ``cpu``)."""

    def current_device(self) -> int:
        """Index of the current device (0 on CPU)."""
        return self.get_current_device().index or 0

    def current_device_index(self) -> int:
        """Index of the current device (0 on CPU); :meth:`current_device` under our name."""
        return self.current_device()

    def get_device_name(self, device: DeviceLike = None) -> str:
        """A human-readable name of ``device``."""
        return self.name

    def get_device_capability(self, device: DeviceLike = None) -> tuple[int, int]:
        """Compute capability ``(major, minor)``; ``(0, 0)`` where there is none (CPU)."""
        return (0, 0)

    def get_version(self) -> str | None:
        """Version of the device runtime torch is built against (None for the CPU)."""
        return None

    def is_bf16_supported(self) -> bool:
        """Whether bfloat16 arithmetic is supported on the current device."""
        return True

    def set_to_device(self, models: _ModuleT | Sequence[_ModuleT]) -> _ModuleT | list[_ModuleT]:
        """Move a module, or each of a list of modules, to the current device.

        A one-element list gives the module itself (ColossalAI's behaviour).
        """
        device = self.get_current_device()
        if isinstance(models, nn.Module):
            return models.to(device)
        moved = [m.to(device) for m in models]
        return moved[0] if len(moved) == 1 else moved

    @abstractmethod
    def synchronize(self, device: DeviceLike = None) -> None:
        """Wait for all queued work on the current device (no-op on CPU)."""

    # ---- streams and events -------------------------------------------------------------
    @abstractmethod
    def Stream(  # noqa: N802 - mirrors torch.cuda.Stream
        self, device: DeviceLike = None, priority: int = 0, **kwargs: object
    ) -> DeviceStream:
        """Create a new stream (a no-op stream object on CPU)."""

    @abstractmethod
    def current_stream(self, device: DeviceLike = None) -> DeviceStream:
        """The stream work is currently queued on."""

    @abstractmethod
    def default_stream(self, device: DeviceLike = None) -> DeviceStream:
        """The device's default stream."""

    @abstractmethod
    def set_stream(self, stream: DeviceStream) -> None:
        """Make ``stream`` the current stream."""

    @abstractmethod
    def stream(self, stream: DeviceStream) -> contextlib.AbstractContextManager[object]:
        """Context manager that queues work on ``stream``."""

    @abstractmethod
    def Event(  # noqa: N802 - mirrors torch.cuda.Event
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> DeviceEvent:
        """Create an event (on CPU one that records the host time when timing is enabled)."""

    # ---- memory -------------------------------------------------------------------------
    @abstractmethod
    def memory_allocated(self, device: DeviceLike = None) -> int:
        """Bytes currently held by tensors (CPU: resident set size of the process)."""

    @abstractmethod
    def max_memory_allocated(self, device: DeviceLike = None) -> int:
        """Peak of :meth:`memory_allocated` since the last reset."""

    @abstractmethod
    def reset_peak_memory_stats(self, device: DeviceLike = None) -> None:
        """Restart peak tracking (allocated and reserved) from the current values."""

    def reset_max_memory_allocated(self, device: DeviceLike = None) -> None:
        """Restart the peak of :meth:`max_memory_allocated`."""
        self.reset_peak_memory_stats(device)

    def reset_max_memory_cached(self, device: DeviceLike = None) -> None:
        """Restart the peak of :meth:`max_memory_reserved`."""
        self.reset_peak_memory_stats(device)

    def memory_reserved(self, device: DeviceLike = None) -> int:
        """Bytes held by the allocator, cached blocks included (CPU: resident set size)."""
        return self.memory_allocated(device)

    def max_memory_reserved(self, device: DeviceLike = None) -> int:
        """Peak of :meth:`memory_reserved` since the last reset."""
        return self.max_memory_allocated(device)

    def memory_stats(self, device: DeviceLike = None) -> dict[str, int]:
        """Allocator statistics under torch.cuda's key names (current and peak bytes)."""
        return {
            "allocated_bytes.all.current": self.memory_allocated(device),
            "allocated_bytes.all.peak": self.max_memory_allocated(device),
            "reserved_bytes.all.current": self.memory_reserved(device),
            "reserved_bytes.all.peak": self.max_memory_reserved(device),
        }

    def memory_summary(self, device: DeviceLike = None, abbreviated: bool = False) -> str:
        """A readable table of :meth:`memory_stats` (MiB)."""
        lines = [f"{self.name} memory summary"]
        for key, value in self.memory_stats(device).items():
            lines.append(f"  {key:<30} {value / 2**20:12.1f} MiB")
        return "\n".join(lines)

    def memory_snapshot(self) -> list[object]:
        """The allocator's segments (empty where there is no caching allocator)."""
        return []

    def set_per_process_memory_fraction(self, fraction: float, device: DeviceLike = None) -> None:
        """Cap this process's share of the device memory (CPU: recorded, not enforced).

        Raises:
            ValueError: ``fraction`` is not in ``[0, 1]``.
        """
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
            raise ValueError(f"fraction must be a number in [0, 1], got {fraction!r}")
        if not 0 <= fraction <= 1:
            raise ValueError(f"fraction must be in [0, 1], got {fraction}")
        self._set_memory_fraction(float(fraction), device)

    def _set_memory_fraction(self, fraction: float, device: DeviceLike) -> None:
        _MEMORY_FRACTION[self.name] = fraction

    def get_per_process_memory_fraction(self) -> float:
        """The fraction last given to :meth:`set_per_process_memory_fraction` (1.0 if none)."""
        return _MEMORY_FRACTION.get(self.name, 1.0)

    @abstractmethod
    def total_memory(self) -> int:
        """Bytes of memory the device has in total."""

    @abstractmethod
    def available_memory(self) -> int:
        """Bytes of memory currently free on the device."""

    def empty_cache(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release cached allocator blocks (no-op where nothing is cached)."""

    def get_device_properties(self, device: DeviceLike = None) -> object:
        """The device's properties (name, total_memory, multi_processor_count...)."""
        return DeviceProperties(self.get_device_name(device), self.total_memory(), 0)

    def utilization(self, device: DeviceLike = None) -> int:
        """Percent of the recent past the device was busy (0 where it cannot be read)."""
        return 0

    # ---- random number generators -------------------------------------------------------
    def get_rng_state(self, device: DeviceLike = None) -> torch.Tensor:
        """The random number generator state of ``device`` (a ByteTensor)."""
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device: DeviceLike = None) -> None:
        """Restore a state from :meth:`get_rng_state`: the same draws follow."""
        torch.set_rng_state(new_state)

    def get_rng_state_all(self) -> list[torch.Tensor]:
        """One state per device."""
        return [self.get_rng_state()]

    def set_rng_state_all(self, new_states: Sequence[torch.Tensor]) -> None:
        """Restore one state per device (from :meth:`get_rng_state_all`).

        Raises:
            ValueError: Not one state per device.
        """
        if len(new_states) != self.device_count():
            raise ValueError(
                f"set_rng_state_all needs one state per {self.name} device "
                f"({self.device_count()}), got {len(new_states)}"
            )
        for index, state in enumerate(new_states):
            self.set_rng_state(state, index)

    def manual_seed(self, seed: int) -> None:
        """Seed the device's random number generators."""
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        """Seed the generators of every device of this kind."""
        self.manual_seed(seed)

    def seed(self) -> None:
        """Seed the current device's generator with a random number."""
        torch.seed()

    def seed_all(self) -> None:
        """Seed every device's generator with a random number."""
        self.seed()

    def initial_seed(self) -> int:
        """The seed the current device's generator was last seeded with."""
        return torch.initial_seed()

    # ---- amp ------------------------------------------------------------------------------
    def autocast(
        self, enabled: bool = True, dtype: torch.dtype = torch.float16, cache_enabled: bool = True
    ) -> contextlib.AbstractContextManager[None]:
        """Autocast context for ``dtype`` on this device type (ColossalAI's signature)."""
        if isinstance(enabled, torch.dtype):  # autocast(torch.bfloat16): the dtype first
            enabled, dtype = True, enabled
        return torch.autocast(
            device_type=self.name, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled
        )

    # ---- misc ---------------------------------------------------------------------------

    @property
    def supports_pin_memory(self) -> bool:
        """Whether host tensors can be pinned for faster copies to this device."""
        return False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(backend={self.communication_backend!r})"


_MEMORY_FRACTION: dict[str, float] = {}


class DeviceProperties:
    """What :meth:`BaseAccelerator.get_device_properties` reports where torch has no type."""

    def __init__(self, name: str, total_memory: int, multi_processor_count: int) -> None:
        self.name = name
        self.total_memory = total_memory
        self.multi_processor_count = multi_processor_count

    def __repr__(self) -> str:
        return (
            f"DeviceProperties(name={self.name!r}, total_memory={self.total_memory}, "
            f"multi_processor_count={self.multi_processor_count})"
        )


class NoOpStream:
    """Stands in for a device stream where work runs synchronously (CPU)."""

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def wait_stream(self, other: object) -> None:
        """Nothing to wait for."""

    def wait_event(self, event: object) -> None:
        """Nothing to wait for."""

    def record_event(self, event: object = None) -> NoOpEvent:
        """Return a completed event."""
        return event if isinstance(event, NoOpEvent) else NoOpEvent()

    def query(self) -> bool:
        """All work on a synchronous stream is complete."""
        return True


class NoOpEvent:
    """Stands in for a device event where work runs synchronously (CPU)."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.enable_timing = enable_timing
        self._time: float | None = None

    def record(self, stream: object = None) -> None:
        """Note the host time (work before it is done: the CPU runs synchronously)."""
        self._time = time.perf_counter()

    def elapsed_time(self, end_event: NoOpEvent) -> float:
        """Milliseconds between this event's record and ``end_event``'s.

        Raises:
            RuntimeError: Timing is off, or an event was not recorded.
        """
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("elapsed_time needs both events created with enable_timing=True")
        if self._time is None or end_event._time is None:
            raise RuntimeError("elapsed_time needs both events recorded first")
        return (end_event._time - self._time) * 1000.0

    def wait(self, stream: object = None) -> None:
        """Nothing to wait for."""

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def query(self) -> bool:
        """Always complete."""
        return True


@contextlib.contextmanager
def noop_stream_context(stream: _T) -> Iterator[_T]:
    """A stream context that changes nothing."""
    yield stream
