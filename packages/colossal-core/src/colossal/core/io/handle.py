"""Handles on background reads and writes."""

from __future__ import annotations

import concurrent.futures
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


class AsyncHandle(Generic[T]):
    """A background IO operation the caller can poll or wait on.

    Args:
        future: The future of the operation's result.
        description: What the operation does, used in error messages.
    """

    def __init__(self, future: concurrent.futures.Future[T], description: str) -> None:
        self._future = future
        self._description = description

    def done(self) -> bool:
        """Whether the operation finished (successfully, with an error, or cancelled)."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> T:
        """Block until the operation finishes and return its result.

        Args:
            timeout: Seconds to wait at most; ``None`` waits for as long as it takes.

        Raises:
            TimeoutError: Not finished after ``timeout`` seconds (the operation goes on).
            concurrent.futures.CancelledError: The operation was cancelled.
            Exception: Whatever the background operation raised.
        """
        try:
            return self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            if self._future.done():
                raise
            raise TimeoutError(f"{self._description} not finished after {timeout}s") from None

    def cancel(self) -> bool:
        """Ask the operation to stop; a cancelled write removes its temporary file.

        Returns:
            ``False`` if it had already finished.
        """
        return self._future.cancel()

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<{type(self).__name__} {self._description} ({state})>"


class WriteHandle(AsyncHandle[str]):
    """Handle on a background safetensors write; :meth:`wait` returns the final path.

    Args:
        future: The future of the write.
        path: The final path of the file.
        released: Completes once the writer no longer reads the caller's tensors (the snapshot
            is taken); the write's own future when ``None`` (the tensors are read until the
            file is written).
    """

    def __init__(
        self,
        future: concurrent.futures.Future[str],
        path: str,
        released: concurrent.futures.Future[None] | None = None,
    ) -> None:
        super().__init__(future, f"write of {path}")
        self.path = path
        self._released: concurrent.futures.Future[None] | concurrent.futures.Future[str] = (
            future if released is None else released
        )

    def released(self) -> bool:
        """Whether the caller's tensors may be modified (the snapshot is complete)."""
        return self._released.done()

    def wait_released(self, timeout: float | None = None) -> None:
        """Block until the writer no longer reads the caller's tensors.

        With a foreground snapshot (the default) this returns at once; with
        ``background_copy=True`` it waits for the background snapshot; with ``copy=False``
        for the whole write.

        Raises:
            TimeoutError: Still reading after ``timeout`` seconds.
            Exception: The snapshot's error (the write then fails with it too).
        """
        try:
            self._released.result(timeout)
        except concurrent.futures.TimeoutError:
            if self._released.done():
                raise
            raise TimeoutError(
                f"{self._description}: tensors still being read after {timeout}s"
            ) from None


class ReadHandle(AsyncHandle[dict[str, torch.Tensor]]):
    """Handle on a background safetensors read; :meth:`wait` returns name -> tensor.

    Args:
        future: The future of the read.
        path: The file being read.
    """

    def __init__(
        self, future: concurrent.futures.Future[dict[str, torch.Tensor]], path: str
    ) -> None:
        super().__init__(future, f"read of {path}")
        self.path = path
