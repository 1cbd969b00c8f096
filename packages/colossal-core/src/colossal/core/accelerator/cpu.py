"""CPU accelerator: gloo, synchronous no-op streams, memory read from /proc."""

from __future__ import annotations

import contextlib
import os

import torch

from colossal.core.accelerator.base import (
    BaseAccelerator,
    DeviceLike,
    DeviceProperties,
    DeviceStream,
    NoOpEvent,
    NoOpStream,
    noop_stream_context,
)

_STATUS = "/proc/self/status"
_DEFAULT_STREAM = NoOpStream()


class _Peak:
    """The peak-RSS fallback where the kernel's mark cannot be reset (no ``clear_refs``)."""

    kernel_resets = True
    tracked = 0


def _is_cpu(device: DeviceLike) -> bool:
    if device is None or device == 0:
        return True
    if isinstance(device, (str, torch.device)):
        return torch.device(device).type == "cpu"
    return False


def _status_kib(field: str) -> int:
    """Read one ``kB`` field of ``/proc/self/status``; 0 where /proc is absent."""
    try:
        with open(_STATUS, encoding="ascii") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class CpuAccelerator(BaseAccelerator):
    """The host CPU. Memory figures are the process's resident set size.

    Memory: ``memory_allocated``/``memory_reserved`` are the resident set size (VmRSS), the
    peaks the kernel's high-water mark (VmHWM), reset through ``/proc/self/clear_refs``
    (where that is not permitted, the peak of the values read since the reset). Random
    numbers: torch's CPU generator. Streams and events run nothing asynchronously (timing
    events record the host clock). ``autocast`` is torch's CPU autocast.
    """

    name = "cpu"
    communication_backend = "gloo"
    is_synchronous = True

    def is_available(self) -> bool:
        """The CPU is always there."""
        return True

    def device_count(self) -> int:
        """One logical CPU device."""
        return 1

    def get_current_device(self) -> torch.device:
        """Always ``cpu``."""
        return torch.device("cpu")

    def set_device(self, device: DeviceLike = None) -> None:
        """Nothing to select on CPU: accepts None, 0, ``"cpu"`` or ``torch.device("cpu")``.

        Raises:
            ValueError: Another device.
        """
        if not _is_cpu(device):
            raise ValueError(
                f"set_device({device!r}) on the CPU accelerator: the only device is 'cpu' "
                "(index 0); set COLOSSAL_ACCELERATOR=cuda on a machine with GPUs"
            )

    def get_device_properties(self, device: DeviceLike = None) -> DeviceProperties:
        """Processor model, physical memory and logical cores."""
        return DeviceProperties(self.get_device_name(), self.total_memory(), os.cpu_count() or 1)

    def utilization(self, device: DeviceLike = None) -> int:
        """The 1-minute load average as a percentage of the logical cores (at most 100)."""
        try:
            load = os.getloadavg()[0]
        except (OSError, AttributeError):
            return 0
        return min(100, round(100 * load / (os.cpu_count() or 1)))

    def get_device_name(self, device: DeviceLike = None) -> str:
        """The processor model where the OS reports it."""
        try:
            with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
                for line in fh:
                    if line.startswith("model name"):
                        return line.split(":", 1)[1].strip()
        except OSError:
            pass
        return "cpu"

    def synchronize(self, device: DeviceLike = None) -> None:
        """CPU work is synchronous."""

    def Stream(  # noqa: N802
        self, device: DeviceLike = None, priority: int = 0, **kwargs: object
    ) -> NoOpStream:
        """A stream that runs nothing asynchronously."""
        return NoOpStream()

    def current_stream(self, device: DeviceLike = None) -> NoOpStream:
        """A stream that runs nothing asynchronously."""
        return _DEFAULT_STREAM

    def default_stream(self, device: DeviceLike = None) -> NoOpStream:
        """A stream that runs nothing asynchronously."""
        return _DEFAULT_STREAM

    def set_stream(self, stream: DeviceStream) -> None:
        """Nothing to switch: every stream is the host."""

    def stream(self, stream: DeviceStream) -> contextlib.AbstractContextManager[object]:
        """A context that changes nothing."""
        return noop_stream_context(stream)

    def Event(  # noqa: N802
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> NoOpEvent:
        """An always-complete event (recording the host clock when timing is enabled)."""
        return NoOpEvent(enable_timing)

    def memory_allocated(self, device: DeviceLike = None) -> int:
        """Resident set size of this process in bytes."""
        rss = _status_kib("VmRSS") * 1024
        _Peak.tracked = max(_Peak.tracked, rss)
        return rss

    def max_memory_allocated(self, device: DeviceLike = None) -> int:
        """Peak resident set size (VmHWM) in bytes since the last reset."""
        if _Peak.kernel_resets:
            return _status_kib("VmHWM") * 1024
        return max(_Peak.tracked, self.memory_allocated())

    def reset_peak_memory_stats(self, device: DeviceLike = None) -> None:
        """Reset the kernel's peak-RSS mark (Linux ``clear_refs``).

        Where that is not permitted, the peak becomes the largest RSS read from now on.
        """
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
                fh.write("5")
        except OSError:
            _Peak.kernel_resets = False
        _Peak.tracked = 0
        self.memory_allocated()

    def total_memory(self) -> int:
        """Physical memory of the machine in bytes."""
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return 0

    def available_memory(self) -> int:
        """Memory the kernel reports as available, in bytes."""
        try:
            with open("/proc/meminfo", encoding="ascii") as fh:
                for line in fh:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return 0
