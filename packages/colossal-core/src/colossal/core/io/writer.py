"""Background, crash-safe safetensors writes on an asyncio loop (aiofiles).

A save snapshots the tensors on the caller's thread (unless ``copy=False``) and writes on the
writer's loop thread: to a temporary file in the target directory, then ``fsync``, an atomic
``os.replace`` onto the final name and an ``fsync`` of the directory. A failed, cancelled or
killed write never leaves a readable file under the final name and never clobbers the file
that was there before.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from collections.abc import AsyncIterator, Mapping
from types import TracebackType

import torch

from colossal.core.io._atomic_file import Source, whole_blocks, write_file_atomically
from colossal.core.io._buffers import ALIGNMENT, StagingPool, tensor_memoryview
from colossal.core.io._loop import EventLoopThread
from colossal.core.io._sources import (
    buffer_chunks,
    direct_chunks,
    packed_chunks,
    stage_tensors,
)
from colossal.core.io.handle import WriteHandle
from colossal.core.io.safetensors_format import layout_tensors

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 32 * 1024 * 1024
"""Bytes per file write."""


class AsyncTensorWriter:
    """Writes dicts of tensors to safetensors files in the background.

    Owns a daemon thread running an asyncio event loop; reusable for any number of files (also
    concurrently). Close it with :meth:`close` or use it as a context manager; writes still
    pending at interpreter exit are finished first.

    By default :meth:`save` snapshots the tensors before it returns, so the caller may modify
    them right away. The copy goes into a staging buffer that is kept for the next save
    (``reuse_staging``) because copying into fresh memory is several times slower (page
    faults). The caller is then blocked for one memory copy of the data, which is small
    against the write time only when storage (with fsync) is much slower than memcpy;
    ``copy=False`` blocks only to hand the tensors over but needs the caller's promise (see
    ``benchmarks/async_io.py``).

    Args:
        chunk_bytes: Bytes per file write (rounded down to whole 4 KiB blocks for direct IO).
        fsync: Make each file durable (fsync the file and its directory) before the handle
            completes. Only turn off for scratch files.
        reuse_staging: Keep snapshot buffers for later saves (memory stays allocated, up to the
            peak bytes in flight at once, until :meth:`release_staging` or :meth:`close`).
            The two chunk-sized bounce buffers of ``copy=False`` direct-IO writes are always
            kept.
        direct_io: Write with ``O_DIRECT`` (bypassing the page cache) where the OS and the
            filesystem support it, else buffered. Direct IO writes by DMA from aligned memory
            (the staging buffer, or with ``copy=False`` two chunk-sized bounce buffers):
            faster than buffered writes on a busy host (see ``benchmarks/async_io.py``), and
            it does not evict the page cache.
        max_workers: Threads that run the blocking file calls.

    Example:
        >>> with AsyncTensorWriter() as writer:
        ...     handle = writer.save(model.state_dict(), "model.safetensors")
        ...     train_one_more_step()
        ...     handle.wait()
    """

    def __init__(
        self,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        fsync: bool = True,
        reuse_staging: bool = True,
        direct_io: bool = True,
        max_workers: int = 2,
    ) -> None:
        if not isinstance(chunk_bytes, int) or chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
        self._chunk_bytes = chunk_bytes
        self._fsync = fsync
        self._direct_io = direct_io
        self._pool = StagingPool(reuse=reuse_staging)
        self._bounce_pool = StagingPool(reuse=True)  # 2 chunks per concurrent copy=False save
        self._loop_thread = EventLoopThread("colossal-async-writer", max_workers=max_workers)
        self._snapshots = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="colossal-async-writer-snapshot"
        )  # background snapshots run one at a time, in submission order

    def save(
        self,
        tensors: Mapping[str, torch.Tensor],
        path: str | os.PathLike[str],
        metadata: Mapping[str, str] | None = None,
        *,
        copy: bool = True,
        background_copy: bool = False,
    ) -> WriteHandle:
        """Start writing ``tensors`` to the safetensors file ``path``.

        Args:
            tensors: Name -> tensor; any device, any dtype safetensors stores, non-contiguous
                allowed.
            path: Final file path; its directory must exist. An existing file is replaced
                atomically once the new one is complete.
            metadata: Optional str -> str dict stored in the header.
            copy: ``True`` (default): snapshot the tensors to CPU memory before returning, so
                the caller may modify them at once. ``False``: write straight from the
                caller's tensors; the caller promises not to modify (or free) them until
                ``wait()`` returns, and ``save`` returns almost at once.
            background_copy: With ``copy=True``, take the snapshot on a background thread
                instead of before returning: ``save`` returns at once and the caller promises
                not to modify the tensors until the handle's ``wait_released()`` returns
                (e.g. call it before the next optimizer step). Snapshots of several saves run
                one after the other, in the order of the calls, ahead of the file writes.

        Returns:
            A handle whose ``wait()`` returns ``path`` (as str) or raises the write's error.

        Raises:
            TypeError: ``tensors`` or ``metadata`` have the wrong types.
            ValueError: A tensor cannot be stored (sparse, meta, unsupported dtype).
            FileNotFoundError: The directory of ``path`` does not exist.
            RuntimeError: The writer is closed.
        """
        self._loop_thread.check_usable()
        target = _check_destination(path)
        header, infos = layout_tensors(tensors, metadata)
        tensors = dict(tensors)  # later changes to the caller's dict do not matter
        size = len(header) + (infos[-1].end if infos else 0)
        chunk_bytes = max(ALIGNMENT, self._chunk_bytes // ALIGNMENT * ALIGNMENT)
        if not copy:

            def direct_source(direct: bool) -> AsyncIterator[memoryview]:
                if direct:
                    bounce = min(chunk_bytes, whole_blocks(size))
                    return packed_chunks(header, infos, tensors, self._bounce_pool, bounce)
                return direct_chunks(header, infos, tensors, self._chunk_bytes)

            job = write_file_atomically(target, direct_source, size, self._fsync, self._direct_io)
            return _handle(self._loop_thread.submit(job), target)
        staging = self._pool.acquire(whole_blocks(size))
        released: concurrent.futures.Future[None] = concurrent.futures.Future()
        try:
            if background_copy:
                snapshot = self._snapshots.submit(stage_tensors, staging, header, infos, tensors)
                snapshot.add_done_callback(lambda f: _chain(f, released))
            else:
                stage_tensors(staging, header, infos, tensors)
                released.set_result(None)
            image = tensor_memoryview(staging)

            def staged_source(direct: bool) -> AsyncIterator[memoryview]:
                return buffer_chunks(image, chunk_bytes)  # aligned whole blocks either way

            job = self._write_staged(target, staged_source, size, staging, released)
            future = self._loop_thread.submit(job)
        except BaseException:
            if released.done():
                self._pool.release(staging)
            else:  # the snapshot still copies into the buffer: recycle it afterwards
                released.add_done_callback(lambda _: self._pool.release(staging))
            raise
        return _handle(future, target, released)

    async def _write_staged(
        self,
        path: str,
        source: Source,
        size: int,
        staging: torch.Tensor,
        released: concurrent.futures.Future[None],
    ) -> str:
        try:
            await asyncio.wrap_future(released)  # the file image is complete
            return await write_file_atomically(path, source, size, self._fsync, self._direct_io)
        finally:
            if released.done():
                self._pool.release(staging)
            else:  # cancelled while the snapshot copies into the buffer
                released.add_done_callback(lambda _: self._pool.release(staging))

    def release_staging(self) -> None:
        """Free the cached snapshot and bounce buffers (those of pending writes when done)."""
        self._pool.clear()
        self._bounce_pool.clear()

    @property
    def staging_bytes(self) -> int:
        """Bytes of snapshot and bounce buffers cached for reuse."""
        return self._pool.cached_bytes + self._bounce_pool.cached_bytes

    def close(self, wait: bool = True) -> None:
        """Stop the writer's thread; idempotent.

        Args:
            wait: Finish pending writes first (default) or cancel them (cancelled writes leave
                neither a final nor a temporary file).
        """
        self._snapshots.shutdown(wait=True, cancel_futures=not wait)
        self._loop_thread.close(wait=wait)
        self.release_staging()

    def __enter__(self) -> AsyncTensorWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(wait=True)


_DEFAULT_LOCK = threading.Lock()
_default_writer: AsyncTensorWriter | None = None


def _get_default_writer() -> AsyncTensorWriter:
    """The shared writer of the module-level functions (it keeps no staging buffers)."""
    global _default_writer
    with _DEFAULT_LOCK:
        writer = _default_writer
        if writer is None or writer._loop_thread._unusable_reason() is not None:
            writer = _default_writer = AsyncTensorWriter(reuse_staging=False)
        return writer


def save_safetensors_async(
    tensors: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    metadata: Mapping[str, str] | None = None,
    *,
    copy: bool = True,
) -> WriteHandle:
    """Start writing ``tensors`` to ``path`` in the background on a shared writer.

    Same arguments and guarantees as :meth:`AsyncTensorWriter.save`. The shared writer keeps
    no snapshot buffers between calls (only its two chunk-sized bounce buffers), so each
    snapshot pays for fresh memory; for repeated saves (checkpoints) keep an
    :class:`AsyncTensorWriter` instead.

    Returns:
        A handle whose ``wait()`` returns ``path``.
    """
    return _get_default_writer().save(tensors, path, metadata, copy=copy)


def save_safetensors(
    tensors: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    metadata: Mapping[str, str] | None = None,
) -> str:
    """Write ``tensors`` to ``path`` and return once the file is durable.

    The same crash-safe code path as the async writer (no snapshot is taken: this call blocks
    until the write is done). Interrupting it (e.g. Ctrl-C) cancels the write.

    Returns:
        ``path`` as str.
    """
    handle = _get_default_writer().save(tensors, path, metadata, copy=False)
    try:
        return handle.wait()
    except BaseException:
        handle.cancel()
        raise


def _handle(
    future: concurrent.futures.Future[str],
    path: str,
    released: concurrent.futures.Future[None] | None = None,
) -> WriteHandle:
    future.add_done_callback(lambda f: _log_failure(f, path))
    return WriteHandle(future, path, released)


def _chain(
    source: concurrent.futures.Future[None], target: concurrent.futures.Future[None]
) -> None:
    """Complete ``target`` like the finished ``source`` (result, error or cancellation)."""
    if source.cancelled():
        target.cancel()
        target.set_running_or_notify_cancel()
    elif source.exception() is not None:
        target.set_exception(source.exception())
    else:
        target.set_result(None)


def _log_failure(future: concurrent.futures.Future[str], path: str) -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.warning("async write of %s failed: %r", path, future.exception())


def _check_destination(path: str | os.PathLike[str]) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    target = os.fsdecode(os.fspath(path))
    directory = os.path.dirname(os.path.abspath(target))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"cannot save {target}: directory {directory} does not exist")
    if os.path.isdir(target):
        raise IsADirectoryError(f"cannot save to {target}: it is a directory")
    return target
