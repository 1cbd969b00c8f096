"""CUDA accelerator: nccl, real streams and the caching allocator's statistics."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import cast

import torch
import torch.distributed as dist

from colossal.core.accelerator.base import BaseAccelerator, DeviceLike, DeviceStream


class CudaAccelerator(BaseAccelerator):
    """NVIDIA (or ROCm through the CUDA API) GPUs: every method is torch.cuda's."""

    name = "cuda"
    communication_backend = "nccl"
    is_synchronous = False

    def is_available(self) -> bool:
        """Whether torch sees at least one CUDA device."""
        return torch.cuda.is_available()

    def device_count(self) -> int:
        """Visible CUDA devices."""
        return torch.cuda.device_count()

    def get_current_device(self) -> torch.device:
        """The current CUDA device."""
        return torch.device("cuda", torch.cuda.current_device())

    def current_device(self) -> int:
        """Index of the current CUDA device."""
        return torch.cuda.current_device()

    def set_device(self, device: DeviceLike = None) -> None:
        """Select ``device``.

        None picks ``LOCAL_RANK`` (or the rank modulo the devices) once torch.distributed is
        initialized, and leaves the current device otherwise.
        """
        if device is None:
            if not dist.is_initialized():
                return
            local = os.environ.get("LOCAL_RANK")
            device = int(local) if local is not None else dist.get_rank() % self.device_count()
        torch.cuda.set_device(device)

    def get_device_name(self, device: DeviceLike = None) -> str:
        """Product name of ``device``."""
        return torch.cuda.get_device_name(device)

    def get_device_capability(self, device: DeviceLike = None) -> tuple[int, int]:
        """Compute capability of ``device``."""
        return torch.cuda.get_device_capability(device)

    def get_device_properties(self, device: DeviceLike = None) -> object:
        """The ``_CudaDeviceProperties`` of ``device``."""
        return torch.cuda.get_device_properties(
            self.get_current_device() if device is None else device
        )

    def utilization(self, device: DeviceLike = None) -> int:
        """Percent of the last sample period a kernel ran (nvidia-smi's figure)."""
        return int(torch.cuda.utilization(device))

    def get_version(self) -> str | None:
        """The CUDA version torch is built against."""
        return torch.version.cuda

    def is_bf16_supported(self) -> bool:
        """Whether the current GPU does bfloat16 arithmetic."""
        return torch.cuda.is_bf16_supported()

    def synchronize(self, device: DeviceLike = None) -> None:
        """Wait for all queued kernels on ``device``."""
        torch.cuda.synchronize(device)

    # ---- streams and events -------------------------------------------------------------
    def Stream(  # noqa: N802
        self, device: DeviceLike = None, priority: int = 0, **kwargs: object
    ) -> torch.cuda.Stream:
        """A new CUDA stream."""
        return torch.cuda.Stream(device, priority, **kwargs)

    def current_stream(self, device: DeviceLike = None) -> torch.cuda.Stream:
        """The current CUDA stream."""
        return torch.cuda.current_stream(device)

    def default_stream(self, device: DeviceLike = None) -> torch.cuda.Stream:
        """The default CUDA stream."""
        return torch.cuda.default_stream(device)

    def set_stream(self, stream: DeviceStream) -> None:
        """Make ``stream`` current."""
        torch.cuda.set_stream(cast(torch.cuda.Stream, stream))

    def stream(self, stream: DeviceStream) -> contextlib.AbstractContextManager[object]:
        """Queue work on ``stream`` (a ``torch.cuda.Stream`` from :meth:`Stream`)."""
        return torch.cuda.stream(cast(torch.cuda.Stream, stream))

    def Event(  # noqa: N802
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> torch.cuda.Event:
        """A new CUDA event."""
        return torch.cuda.Event(
            enable_timing=enable_timing, blocking=blocking, interprocess=interprocess
        )

    # ---- memory -------------------------------------------------------------------------
    def memory_allocated(self, device: DeviceLike = None) -> int:
        """Bytes held by tensors on ``device``."""
        return torch.cuda.memory_allocated(device)

    def max_memory_allocated(self, device: DeviceLike = None) -> int:
        """Peak bytes held by tensors since the last reset."""
        return torch.cuda.max_memory_allocated(device)

    def reset_peak_memory_stats(self, device: DeviceLike = None) -> None:
        """Restart the allocator's peak tracking."""
        torch.cuda.reset_peak_memory_stats(device)

    def memory_reserved(self, device: DeviceLike = None) -> int:
        """Bytes the caching allocator holds (tensors and cached blocks)."""
        return torch.cuda.memory_reserved(device)

    def max_memory_reserved(self, device: DeviceLike = None) -> int:
        """Peak of :meth:`memory_reserved` since the last reset."""
        return torch.cuda.max_memory_reserved(device)

    def memory_stats(self, device: DeviceLike = None) -> dict[str, int]:
        """torch.cuda's allocator statistics."""
        return dict(torch.cuda.memory_stats(device))

    def memory_summary(self, device: DeviceLike = None, abbreviated: bool = False) -> str:
        """torch.cuda's allocator table."""
        return torch.cuda.memory_summary(device, abbreviated)

    def memory_snapshot(self) -> list[object]:
        """torch.cuda's allocator segments."""
        return list(torch.cuda.memory_snapshot())

    def _set_memory_fraction(self, fraction: float, device: DeviceLike) -> None:
        super()._set_memory_fraction(fraction, device)
        torch.cuda.set_per_process_memory_fraction(fraction, device)

    def total_memory(self) -> int:
        """Total memory of the current device."""
        return torch.cuda.get_device_properties(self.get_current_device()).total_memory

    def available_memory(self) -> int:
        """Free memory of the current device as the driver reports it."""
        return torch.cuda.mem_get_info()[0]

    def empty_cache(self) -> None:
        """Return cached blocks to the driver."""
        torch.cuda.empty_cache()

    # ---- random number generators -------------------------------------------------------
    def get_rng_state(self, device: DeviceLike = None) -> torch.Tensor:
        """The generator state of ``device`` (the current one by default)."""
        return torch.cuda.get_rng_state("cuda" if device is None else device)

    def set_rng_state(self, new_state: torch.Tensor, device: DeviceLike = None) -> None:
        """Restore the generator state of ``device``."""
        torch.cuda.set_rng_state(new_state, "cuda" if device is None else device)

    def get_rng_state_all(self) -> list[torch.Tensor]:
        """One state per visible GPU."""
        return list(torch.cuda.get_rng_state_all())

    def set_rng_state_all(self, new_states: Sequence[torch.Tensor]) -> None:
        """Restore one state per visible GPU."""
        torch.cuda.set_rng_state_all(list(new_states))

    def manual_seed(self, seed: int) -> None:
        """Seed the host and every CUDA device."""
        torch.manual_seed(seed)
        torch.cuda.manual_seed_all(seed)

    def manual_seed_all(self, seed: int) -> None:
        """Seed every CUDA device."""
        torch.cuda.manual_seed_all(seed)

    def seed(self) -> None:
        """Seed the current GPU with a random number."""
        torch.cuda.seed()

    def seed_all(self) -> None:
        """Seed every GPU with a random number."""
        torch.cuda.seed_all()

    def initial_seed(self) -> int:
        """The current GPU generator's seed."""
        return torch.cuda.initial_seed()

    @property
    def supports_pin_memory(self) -> bool:
        """Pinned host memory speeds up host-device copies."""
        return True
