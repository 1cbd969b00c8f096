"""CUDA accelerator: nccl, real streams and the caching allocator's statistics."""

from __future__ import annotations

import contextlib
from typing import cast

import torch

from colossal.core.accelerator.base import BaseAccelerator, DeviceStream


class CudaAccelerator(BaseAccelerator):
    """NVIDIA (or ROCm through the CUDA API) GPUs."""

    name = "cuda"
    communication_backend = "nccl"

    def is_available(self) -> bool:
        """Whether torch sees at least one CUDA device."""
        return torch.cuda.is_available()

    def device_count(self) -> int:
        """Visible CUDA devices."""
        return torch.cuda.device_count()

    def get_current_device(self) -> torch.device:
        """The current CUDA device."""
        return torch.device("cuda", torch.cuda.current_device())

    def set_device(self, index: int | None) -> None:
        """Select device ``index`` (or leave the current one when ``None``)."""
        if index is not None:
            torch.cuda.set_device(index)

    def get_device_name(self) -> str:
        """Product name of the current device."""
        return torch.cuda.get_device_name()

    def synchronize(self) -> None:
        """Wait for all queued kernels on the current device."""
        torch.cuda.synchronize()

    def Stream(self) -> torch.cuda.Stream:  # noqa: N802
        """A new CUDA stream."""
        return torch.cuda.Stream()

    def current_stream(self) -> torch.cuda.Stream:
        """The current CUDA stream."""
        return torch.cuda.current_stream()

    def stream(self, stream: DeviceStream) -> contextlib.AbstractContextManager[object]:
        """Queue work on ``stream`` (a ``torch.cuda.Stream`` from :meth:`Stream`)."""
        return torch.cuda.stream(cast(torch.cuda.Stream, stream))

    def Event(self, enable_timing: bool = False) -> torch.cuda.Event:  # noqa: N802
        """A new CUDA event."""
        return torch.cuda.Event(enable_timing=enable_timing)

    def memory_allocated(self) -> int:
        """Bytes held by tensors on the current device."""
        return torch.cuda.memory_allocated()

    def max_memory_allocated(self) -> int:
        """Peak bytes held by tensors since the last reset."""
        return torch.cuda.max_memory_allocated()

    def reset_peak_memory_stats(self) -> None:
        """Restart the allocator's peak tracking."""
        torch.cuda.reset_peak_memory_stats()

    def total_memory(self) -> int:
        """Total memory of the current device."""
        return torch.cuda.get_device_properties(self.get_current_device()).total_memory

    def available_memory(self) -> int:
        """Free memory of the current device as the driver reports it."""
        return torch.cuda.mem_get_info()[0]

    def empty_cache(self) -> None:
        """Return cached blocks to the driver."""
        torch.cuda.empty_cache()

    def manual_seed(self, seed: int) -> None:
        """Seed the host and every CUDA device."""
        torch.manual_seed(seed)
        torch.cuda.manual_seed_all(seed)

    @property
    def supports_pin_memory(self) -> bool:
        """Pinned host memory speeds up host-device copies."""
        return True
