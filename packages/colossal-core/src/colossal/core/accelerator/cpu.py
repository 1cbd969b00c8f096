"""CPU accelerator: gloo, synchronous no-op streams, memory read from /proc."""

from __future__ import annotations

import contextlib
import os

import torch

from colossal.core.accelerator.base import (
    BaseAccelerator,
    DeviceStream,
    NoOpEvent,
    NoOpStream,
    noop_stream_context,
)

_STATUS = "/proc/self/status"


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
    """The host CPU. Memory figures are the process's resident set size."""

    name = "cpu"
    communication_backend = "gloo"

    def is_available(self) -> bool:
        """The CPU is always there."""
        return True

    def device_count(self) -> int:
        """One logical CPU device."""
        return 1

    def get_current_device(self) -> torch.device:
        """Always ``cpu``."""
        return torch.device("cpu")

    def set_device(self, index: int | None) -> None:
        """Nothing to select on CPU."""

    def get_device_name(self) -> str:
        """The processor model where the OS reports it."""
        try:
            with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
                for line in fh:
                    if line.startswith("model name"):
                        return line.split(":", 1)[1].strip()
        except OSError:
            pass
        return "cpu"

    def synchronize(self) -> None:
        """CPU work is synchronous."""

    def Stream(self) -> NoOpStream:  # noqa: N802
        """A stream that runs nothing asynchronously."""
        return NoOpStream()

    def current_stream(self) -> NoOpStream:
        """A stream that runs nothing asynchronously."""
        return NoOpStream()

    def stream(self, stream: DeviceStream) -> contextlib.AbstractContextManager[object]:
        """A context that changes nothing."""
        return noop_stream_context(stream)

    def Event(self, enable_timing: bool = False) -> NoOpEvent:  # noqa: N802
        """An always-complete event."""
        return NoOpEvent(enable_timing)

    def memory_allocated(self) -> int:
        """Resident set size of this process in bytes."""
        return _status_kib("VmRSS") * 1024

    def max_memory_allocated(self) -> int:
        """Peak resident set size (VmHWM) in bytes since the last reset."""
        return _status_kib("VmHWM") * 1024

    def reset_peak_memory_stats(self) -> None:
        """Reset the kernel's peak-RSS mark (Linux ``clear_refs``); silently skipped elsewhere."""
        with contextlib.suppress(OSError):
            with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
                fh.write("5")

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
