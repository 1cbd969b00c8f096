"""Choosing the accelerator for this process."""

from __future__ import annotations

import os

from colossal.core.accelerator.base import BaseAccelerator
from colossal.core.accelerator.cpu import CpuAccelerator
from colossal.core.accelerator.cuda import CudaAccelerator

ENV_VAR = "COLOSSAL_ACCELERATOR"
_KINDS: dict[str, type[BaseAccelerator]] = {"cpu": CpuAccelerator, "cuda": CudaAccelerator}


def get_accelerator(name: str | None = None) -> BaseAccelerator:
    """Return the accelerator this process should use.

    Args:
        name: ``"cpu"`` or ``"cuda"``. When ``None``, the ``COLOSSAL_ACCELERATOR`` environment
            variable decides, and without it CUDA is chosen when available, else the CPU.

    Returns:
        A new accelerator object (they are stateless and cheap).

    Raises:
        ValueError: ``name`` (or the environment variable) names an unknown accelerator, or
            names CUDA where no CUDA device is available.
    """
    source = "argument"
    if name is None:
        name = os.environ.get(ENV_VAR) or None
        source = f"environment variable {ENV_VAR}"
    if name is None:
        cuda = CudaAccelerator()
        return cuda if cuda.is_available() else CpuAccelerator()
    key = name.strip().lower()
    if key not in _KINDS:
        raise ValueError(
            f"unknown accelerator {name!r} (from the {source}); choose one of {sorted(_KINDS)}"
        )
    accelerator = _KINDS[key]()
    if not accelerator.is_available():
        raise ValueError(
            f"accelerator {name!r} (from the {source}) is not available on this machine; "
            f"use 'cpu' or unset {ENV_VAR}"
        )
    return accelerator
