"""``DummyDataloader``: a fixed number of batches from a generator function."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

__all__ = ["DummyDataloader"]

_B = TypeVar("_B")


class DummyDataloader(Generic[_B]):
    """Yields ``data_gen_fn()`` ``length`` times per iteration (ColossalAI's test loader).

    Args:
        data_gen_fn: Makes one batch.
        length: Batches per pass (``len()`` of the loader).

    Raises:
        ValueError: ``length`` is negative.
    """

    def __init__(self, data_gen_fn: Callable[[], _B], length: int = 10) -> None:
        if not isinstance(length, int) or length < 0:
            raise ValueError(f"DummyDataloader: length must be an int >= 0, got {length!r}")
        self.data_gen_fn = data_gen_fn
        self.length = length

    def __iter__(self) -> Iterator[_B]:
        return (self.data_gen_fn() for _ in range(self.length))

    def __len__(self) -> int:
        return self.length
