"""The device abstraction every Colossal package programs against."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Protocol, TypeVar

import torch

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


class BaseAccelerator(ABC):
    """A compute device family (CPU, CUDA) behind one small interface.

    Code elsewhere in Colossal never names a device type directly; it asks the accelerator for
    the current device, the communication backend, streams and memory figures.

    Attributes:
        name: Short device type name (``"cpu"``, ``"cuda"``).
        communication_backend: The ``torch.distributed`` backend that suits this device.
    """

    name: str = ""
    communication_backend: str = ""

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
    def set_device(self, index: int | None) -> None:
        """Make device ``index`` current for this process (no-op on CPU)."""

    def current_device_index(self) -> int:
        """Index of the current device (0 on CPU)."""
        return self.get_current_device().index or 0

    def get_device_name(self) -> str:
        """A human-readable name of the current device."""
        return self.name

    @abstractmethod
    def synchronize(self) -> None:
        """Wait for all queued work on the current device (no-op on CPU)."""

    # ---- streams and events -------------------------------------------------------------
    @abstractmethod
    def Stream(self) -> DeviceStream:  # noqa: N802 - mirrors torch.cuda.Stream
        """Create a new stream (a no-op stream object on CPU)."""

    @abstractmethod
    def current_stream(self) -> DeviceStream:
        """The stream work is currently queued on."""

    @abstractmethod
    def stream(self, stream: DeviceStream) -> contextlib.AbstractContextManager[object]:
        """Context manager that queues work on ``stream``."""

    @abstractmethod
    def Event(self, enable_timing: bool = False) -> DeviceEvent:  # noqa: N802 - mirrors torch.cuda.Event
        """Create an event (a no-op event object on CPU)."""

    # ---- memory -------------------------------------------------------------------------
    @abstractmethod
    def memory_allocated(self) -> int:
        """Bytes currently held by tensors (CPU: resident set size of the process)."""

    @abstractmethod
    def max_memory_allocated(self) -> int:
        """Peak of :meth:`memory_allocated` since the last reset."""

    @abstractmethod
    def reset_peak_memory_stats(self) -> None:
        """Restart peak tracking from the current value."""

    @abstractmethod
    def total_memory(self) -> int:
        """Bytes of memory the device has in total."""

    @abstractmethod
    def available_memory(self) -> int:
        """Bytes of memory currently free on the device."""

    def empty_cache(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release cached allocator blocks (no-op where nothing is cached)."""

    # ---- misc ---------------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        """Seed the device's random number generators."""
        torch.manual_seed(seed)

    def autocast(self, dtype: torch.dtype) -> contextlib.AbstractContextManager[None]:
        """Autocast context for ``dtype`` on this device type."""
        return torch.autocast(device_type=self.name, dtype=dtype)

    @property
    def supports_pin_memory(self) -> bool:
        """Whether host tensors can be pinned for faster copies to this device."""
        return False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(backend={self.communication_backend!r})"


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

    def record(self, stream: object = None) -> None:
        """Nothing to record."""

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
