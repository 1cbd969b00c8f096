"""Tensors placed on a *logical* location, with every allocation reported to a budget.

A chunk's storage lives in one of two logical places: ``"device"`` (the accelerator; on a
CPU-only run still a CPU tensor, but accounted as device memory) and ``"host"`` (CPU, the
offload target, pinned when asked and CUDA is available). Accounting follows the logical
location, which is what makes offload and eviction testable on a CPU.
"""

from __future__ import annotations

from typing import Literal, Protocol

import torch

from colossal.core import get_accelerator

Location = Literal["device", "host"]
LOCATIONS: tuple[Location, ...] = ("device", "host")


class BudgetLike(Protocol):
    """What a chunk needs from ``colossal.gemini.DeviceMemoryBudget``."""

    def allocate(self, location: Location, nbytes: int, what: str) -> None:
        """Account ``nbytes`` more on ``location`` (may raise when over capacity)."""

    def free(self, location: Location, nbytes: int) -> None:
        """Account ``nbytes`` less on ``location``."""

    def move(self, src: Location, dst: Location, nbytes: int, what: str) -> None:
        """Account ``nbytes`` moving from ``src`` to ``dst``."""


def check_location(location: object) -> Location:
    """Return ``location`` if it is ``"device"`` or ``"host"``, else raise ValueError."""
    if location not in LOCATIONS:
        raise ValueError(f"location must be 'device' or 'host', got {location!r}")
    return location


def physical_device(location: Location) -> torch.device:
    """The torch device behind a logical location."""
    if location == "device":
        return get_accelerator().get_current_device()
    return torch.device("cpu")


def _pin(location: Location, pin_memory: bool) -> bool:
    return location == "host" and pin_memory and torch.cuda.is_available()


def nbytes(t: torch.Tensor | None) -> int:
    """Bytes of a tensor's elements (0 for ``None``)."""
    return 0 if t is None else t.numel() * t.element_size()


class Allocator:
    """Allocates, moves and frees tensors on logical locations, reporting to a budget.

    Args:
        budget: Receives every allocation, free and move (``None``: no accounting).
        pin_memory: Pin host tensors when CUDA is available.
        owner: Prefix of the ``what`` named in budget errors (e.g. ``"chunk 3"``).
    """

    def __init__(self, budget: BudgetLike | None, pin_memory: bool, owner: str) -> None:
        self.budget = budget
        self.pin_memory = pin_memory
        self.owner = owner

    def empty(self, location: Location, numel: int, dtype: torch.dtype, what: str) -> torch.Tensor:
        """An uninitialized tensor on ``location``, accounted before it is allocated."""
        size = numel * dtype.itemsize
        if self.budget is not None:
            self.budget.allocate(location, size, f"{self.owner} {what}")
        return torch.empty(
            numel,
            dtype=dtype,
            device=physical_device(location),
            pin_memory=_pin(location, self.pin_memory),
        )

    def zeros(self, location: Location, numel: int, dtype: torch.dtype, what: str) -> torch.Tensor:
        """A zero-filled tensor on ``location``."""
        return self.empty(location, numel, dtype, what).zero_()

    def copy_of(
        self, src: torch.Tensor, location: Location, dtype: torch.dtype, what: str
    ) -> torch.Tensor:
        """A new flat tensor on ``location`` holding ``src`` cast to ``dtype``."""
        out = self.empty(location, src.numel(), dtype, what)
        out.copy_(src.reshape(-1))
        return out

    def free(self, t: torch.Tensor | None, location: Location) -> None:
        """Account the release of ``t`` (the caller drops its reference)."""
        if t is not None and self.budget is not None:
            self.budget.free(location, nbytes(t))

    def move(self, t: torch.Tensor, src: Location, dst: Location, what: str) -> torch.Tensor:
        """``t`` copied to ``dst`` (``t`` itself when ``src == dst``)."""
        if src == dst:
            return t
        if self.budget is not None:
            self.budget.move(src, dst, nbytes(t), f"{self.owner} {what}")
        out = torch.empty(
            t.numel(),
            dtype=t.dtype,
            device=physical_device(dst),
            pin_memory=_pin(dst, self.pin_memory),
        )
        out.copy_(t, non_blocking=False)
        return out
