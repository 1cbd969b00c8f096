"""Device abstraction: ``get_accelerator()`` picks CUDA when present, else the CPU."""

from colossal.core.accelerator.api import get_accelerator
from colossal.core.accelerator.base import (
    BaseAccelerator,
    DeviceEvent,
    DeviceProperties,
    DeviceStream,
    NoOpEvent,
    NoOpStream,
)
from colossal.core.accelerator.cpu import CpuAccelerator
from colossal.core.accelerator.cuda import CudaAccelerator

__all__ = [
    "BaseAccelerator",
    "CpuAccelerator",
    "CudaAccelerator",
    "DeviceEvent",
    "DeviceProperties",
    "DeviceStream",
    "NoOpEvent",
    "NoOpStream",
    "get_accelerator",
]
