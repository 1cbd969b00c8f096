"""Optimizer state kept in files, read ahead and written back in the background.

Each offloaded parameter has one file holding its ``exp_avg`` and ``exp_avg_sq`` back to back
(fp32, padded to whole :data:`~colossal.core.io.ALIGNMENT` blocks). When the filesystem allows
it the files are opened with ``O_DIRECT``: the state moves between RAM and the device by DMA,
so it really leaves memory (not parked in the page cache) and the IO costs almost no CPU time,
leaving the cores to the Adam kernel. Buffered IO (the fallback) copies every byte through the
page cache on the CPU, which competes with the update on a machine with few cores. During a
step, :class:`StatePipeline` reads the states of the next few offloaded
params into a small ring of reusable buffers while the current one updates, and writes each
updated state back as soon as its update is done. The file IO goes through core's aiofiles
tensor IO (:class:`colossal.core.io.TensorFileIO`), which runs operations in submission
order on one IO thread, so a buffer is never refilled before its previous contents are
written out and a file is never read before its last write finished. Files stay open
between steps and are read into / written from the buffers' memory without copies.

The files live in a fresh temporary directory that is removed by :meth:`NVMeStateStore.close`,
when the store is garbage-collected, and at interpreter exit.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from colossal.core.io import ALIGNMENT, TensorFileIO, direct_io_supported, empty_aligned
from colossal.core.logging import get_logger

logger = get_logger(__name__)

_BLOCK = ALIGNMENT // 4  # fp32 elements per alignment block


def padded(numel: int) -> int:
    """``numel`` fp32 elements rounded up to whole alignment blocks (a file record's size)."""
    return -(-numel // _BLOCK) * _BLOCK


def _cleanup(directory: str, io: TensorFileIO) -> None:
    io.close(wait=True)
    shutil.rmtree(directory, ignore_errors=True)


class NVMeStateStore:
    """Files holding offloaded optimizer states, with asynchronous reads and writes.

    Args:
        directory: Parent directory of the temporary directory (``None``: the system temp
            directory). Created if missing.
        direct_io: Bypass the page cache with ``O_DIRECT``: ``None`` when the filesystem
            supports it, ``True`` to require it, ``False`` for buffered IO.

    Raises:
        ValueError: ``directory`` exists and is not a directory, or ``direct_io=True`` and
            its filesystem refuses ``O_DIRECT``.
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None,
                 direct_io: bool | None = None) -> None:
        if directory is not None:
            directory = os.fspath(directory)
            if os.path.exists(directory) and not os.path.isdir(directory):
                raise ValueError(
                    f"nvme_offload_dir={directory!r} is not a directory; pass a directory on "
                    "the fast local disk (or None for the system temp directory)"
                )
            os.makedirs(directory, exist_ok=True)
        self.directory = tempfile.mkdtemp(prefix="colossal-nvme-", dir=directory)
        supported = direct_io_supported(self.directory)
        if direct_io and not supported:
            shutil.rmtree(self.directory, ignore_errors=True)
            raise ValueError(
                f"nvme_direct_io=True but the filesystem of {self.directory!r} refuses "
                "O_DIRECT; pass nvme_direct_io=None (buffered fallback) or a directory on a "
                "local disk"
            )
        self.direct_io = supported if direct_io is None else bool(direct_io)
        self._io = TensorFileIO(keep_open=True, name="colossal-nvme", direct_io=self.direct_io)
        self._pending: list[concurrent.futures.Future[Any]] = []
        self._buffers: list[torch.Tensor] = []
        self._closed = False
        self._finalizer = weakref.finalize(self, _cleanup, self.directory, self._io)

    @property
    def io_cpu_seconds(self) -> float:
        """CPU seconds the IO thread spent in file calls (open, seek, read, write) so far.

        Buffered IO is CPU work (the kernel copies to and from the page cache); a read
        waiting for the device is not. Measured per call on the IO thread by
        :attr:`colossal.core.io.TensorFileIO.cpu_seconds`.
        """
        return self._io.cpu_seconds

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (the files are gone)."""
        return self._closed

    def path(self, key: int) -> str:
        """File holding the states with key ``key``."""
        return os.path.join(self.directory, f"state-{key}.bin")

    def _track(self, submit: Callable[..., concurrent.futures.Future[Any]], *args: Any
               ) -> concurrent.futures.Future[Any]:
        if self._closed:
            raise RuntimeError("the NVMe state store is closed; its files were removed")
        future = submit(*args)
        self._pending = [f for f in self._pending if not f.done() or f.exception()]
        self._pending.append(future)
        return future

    def read_async(self, key: int, out: torch.Tensor) -> concurrent.futures.Future[Any]:
        """Fill ``out`` from the file of ``key`` (zeros if never written) in the background.

        ``out`` comes from :meth:`buffers` (or :func:`~colossal.core.io.empty_aligned`) and has
        :func:`padded` elements.
        """
        return self._track(functools.partial(self._io.read_into, missing_ok=True),
                           self.path(key), out)

    def write_async(self, key: int, src: torch.Tensor) -> concurrent.futures.Future[Any]:
        """Write ``src`` (aligned and padded as for :meth:`read_async`) to ``key``'s file."""
        return self._track(self._io.write_from, self.path(key), src)

    def read(self, key: int, numel: int) -> torch.Tensor:
        """A new fp32 tensor of ``numel`` elements with the contents of ``key``'s file."""
        out = empty_aligned(padded(numel))
        self.read_async(key, out).result()
        return out[:numel]

    def write(self, key: int, *parts: torch.Tensor) -> None:
        """Write ``parts`` (CPU tensors, converted to fp32) back to back to ``key``'s file."""
        numel = sum(t.numel() for t in parts)
        staged = empty_aligned(padded(numel))
        start = 0
        for t in parts:
            staged[start : start + t.numel()].copy_(t.reshape(-1))
            start += t.numel()
        staged[numel:].zero_()
        self.write_async(key, staged).result()

    def buffers(self, numel: int, count: int) -> list[torch.Tensor]:
        """``count`` reusable aligned fp32 buffers of at least ``padded(numel)`` elements."""
        numel = padded(numel)
        if len(self._buffers) < count or self._buffers[0].numel() < numel:
            self.flush()
            self._buffers = [empty_aligned(numel) for _ in range(count)]
        return self._buffers[:count]

    def flush(self) -> None:
        """Wait for every queued read and write; re-raise the first IO error."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def close(self) -> None:
        """Wait for queued IO (errors are logged), then delete the files. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for future in self._pending:
            try:
                future.result()
            except Exception as exc:  # noqa: BLE001 - closing anyway
                logger.warning("NVMe state IO failed while closing: %s", exc)
        self._pending = []
        self._buffers = []
        self._finalizer()


class StatePipeline:
    """Streams the offloaded states of one step through a ring of buffers.

    Reads for the first ``depth`` items are queued on construction, so they overlap whatever
    the caller computes before iterating. Iterating yields ``(index, exp_avg, exp_avg_sq)``
    with the item's states loaded; when the caller asks for the next item, the previous one's
    states are queued for writing and the read ``depth`` items ahead is queued.

    Args:
        store: The store holding the files.
        items: ``(key, numel)`` per offloaded param, in update order.
        depth: Number of buffers (reads in flight).
        before_wait: Called with ``i`` before waiting for item ``i``'s read (the caller
            interleaves in-memory updates there so they overlap the IO).
    """

    def __init__(self, store: NVMeStateStore, items: Sequence[tuple[int, int]],
                 depth: int = 3, before_wait: Callable[[int], None] | None = None) -> None:
        self.store = store
        self.before_wait = before_wait
        self.items = list(items)
        self.depth = max(1, min(depth, len(self.items)))
        largest = max((n for _, n in self.items), default=0)
        self._slots = store.buffers(2 * largest, self.depth) if self.items else []
        self._reads: dict[int, concurrent.futures.Future[Any]] = {}
        self.waited = 0.0  # seconds the iteration blocked on reads
        for i in range(self.depth):
            self._queue_read(i)

    def _buffer(self, i: int) -> torch.Tensor:
        return self._slots[i % self.depth][: padded(2 * self.items[i][1])]

    def _queue_read(self, i: int) -> None:
        if i < len(self.items):
            self._reads[i] = self.store.read_async(self.items[i][0], self._buffer(i))

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        for i, (key, numel) in enumerate(self.items):
            if self.before_wait is not None:
                self.before_wait(i)  # in-memory work that overlaps the read
            start = time.perf_counter()
            self._reads.pop(i).result()
            self.waited += time.perf_counter() - start
            buf = self._buffer(i)
            yield i, buf[:numel], buf[numel : 2 * numel]
            self.store.write_async(key, buf)
            self._queue_read(i + self.depth)
