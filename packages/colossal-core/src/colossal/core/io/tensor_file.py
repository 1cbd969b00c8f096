"""Raw tensor bytes to and from files, in the background, with aiofiles.

:class:`TensorFileIO` reads a file straight into the memory of a preallocated contiguous CPU
tensor and writes a tensor's bytes into a file in place (no truncation), on the same
event-loop thread machinery as the safetensors reader and writer. The files hold raw bytes
(no header): use it for scratch and staging files whose layout the caller knows, e.g.
offloaded optimizer states.

Each operation is one positional, vectored call (``os.preadv``/``os.pwritev`` on a
memoryview of the tensor's memory: no extra copy) dispatched by ``aiofiles`` from the event
loop to a single IO thread. One call per operation keeps the IO thread busy back to back: a
design with several awaited calls per operation (open, seek, ``readinto``) pays an event-loop
round trip between them (measured: colossal-core's CHANGELOG). The caller must not touch a
tensor until the future of the operation using it is done.

With ``direct_io=True`` the files are opened with ``O_DIRECT``: the bytes go between the
tensor and the device by DMA, bypassing the page cache, so the IO costs almost no CPU time and
the data really leaves RAM (what offloading to NVMe is for). Buffered IO copies every byte
through the page cache on the CPU. Direct IO needs the tensor's address, the file offset and
the byte count to be multiples of :data:`ALIGNMENT` (allocate with :func:`empty_aligned`, pad
lengths); :func:`direct_io_supported` says whether a directory's filesystem accepts it.

Example:
    >>> io = TensorFileIO(keep_open=True)
    >>> io.write_from("/tmp/state.bin", torch.arange(4.0)).result()
    16
    >>> out = torch.empty(4)
    >>> io.read_into("/tmp/state.bin", out).result()
    16
    >>> io.close()
"""

from __future__ import annotations

import concurrent.futures
import errno
import os
import tempfile
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

import aiofiles.os
import torch

from colossal.core.io._buffers import ALIGNMENT, empty_aligned, tensor_memoryview
from colossal.core.io._loop import EventLoopThread

T = TypeVar("T")


__all__ = [
    "TensorFileIO",
    "direct_io_supported",
    "read_tensor_file_async",
    "write_tensor_file_async",
]


class _TimedExecutor(concurrent.futures.ThreadPoolExecutor):
    """A one-thread executor that adds up the CPU time its thread spends in submitted calls."""

    def __init__(self, name: str) -> None:
        super().__init__(max_workers=1, thread_name_prefix=f"{name}-io")
        self.cpu_seconds = 0.0

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any
               ) -> concurrent.futures.Future[T]:
        return super().submit(self._timed, fn, *args, **kwargs)

    def _timed(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        start = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:  # the only worker thread adds to it
            self.cpu_seconds += time.thread_time() - start


def _check_tensor(tensor: object, what: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(
            f"{what} must be a contiguous CPU tensor (got device={tensor.device}, "
            f"contiguous={tensor.is_contiguous()}); pass tensor.contiguous().cpu()"
        )
    return tensor


def _check_offset(offset: object) -> int:
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"offset={offset!r} is invalid; use a byte offset >= 0")
    return offset


def _check_aligned(tensor: torch.Tensor, offset: int, what: str) -> None:
    """Raise ``ValueError`` unless ``O_DIRECT`` can move ``tensor`` at ``offset``."""
    misaligned = {name: value for name, value in (
        ("address", tensor.data_ptr()), ("offset", offset), ("byte count", tensor.nbytes),
    ) if value % ALIGNMENT}
    if misaligned:
        detail = ", ".join(f"{name} {value} (remainder {value % ALIGNMENT})"
                           for name, value in misaligned.items())
        raise ValueError(
            f"direct_io needs {what}'s address, the offset and the byte count to be multiples "
            f"of {ALIGNMENT}; got {detail}. Allocate with colossal.core.io.empty_aligned() and "
            "pad lengths, or use TensorFileIO(direct_io=False)"
        )


def direct_io_supported(directory: str | os.PathLike[str]) -> bool:
    """Whether files in ``directory`` can be read and written with ``O_DIRECT``.

    Probes with a one-block scratch file (removed again). ``False`` on platforms without
    ``O_DIRECT`` and on filesystems that refuse it.
    """
    if not hasattr(os, "O_DIRECT"):
        return False
    fd, path = tempfile.mkstemp(prefix=".colossal-direct-probe-", dir=os.fspath(directory))
    os.close(fd)
    block = empty_aligned(ALIGNMENT, torch.uint8).fill_(7)
    view = tensor_memoryview(block)
    try:
        fd = os.open(path, os.O_RDWR | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))
        try:
            return os.pwritev(fd, [view], 0) == ALIGNMENT == os.preadv(fd, [view], 0)
        finally:
            os.close(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
            raise
        return False
    finally:
        view.release()
        os.unlink(path)


class TensorFileIO:
    """Reads files into tensors and writes tensors into files on an aiofiles event loop.

    Operations run one at a time, in the order they were submitted (from any thread): a read
    submitted after a write of the same file sees the written bytes, and a tensor given to a
    write may be refilled by a read submitted after it. Each returns a
    ``concurrent.futures.Future`` that raises the operation's error.

    Args:
        keep_open: Keep each file open after its first use (until :meth:`release` or
            :meth:`close`), saving an open and a close per operation on files used often.
        name: Name of the event-loop thread (its IO thread is ``name + "-io"``).
        direct_io: Open files with ``O_DIRECT`` (page cache bypassed; tensors, offsets and
            lengths must be aligned, see the module docstring). Check the directory with
            :func:`direct_io_supported` first: a filesystem refusing it fails each operation.

    Raises:
        ValueError: ``direct_io`` on a platform without ``O_DIRECT``.
    """

    def __init__(self, *, keep_open: bool = False, name: str = "colossal-tensor-file",
                 direct_io: bool = False) -> None:
        if direct_io and not hasattr(os, "O_DIRECT"):
            raise ValueError("direct_io=True needs O_DIRECT, which this platform lacks; "
                             "use direct_io=False")
        self._keep_open = bool(keep_open)
        self._direct = bool(direct_io)
        self._executor = _TimedExecutor(name)
        self._loop_thread = EventLoopThread(name, max_workers=1)
        self._files: dict[str, tuple[int, bool]] = {}  # path -> (fd, writable); IO thread
        self._close_lock = threading.Lock()

    @property
    def cpu_seconds(self) -> float:
        """CPU seconds the IO thread spent in operations (open, read, write, close).

        Buffered file IO is CPU work (the OS copies between the page cache and the tensor);
        time spent waiting for the device is not counted.
        """
        return self._executor.cpu_seconds

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._loop_thread.closed

    @property
    def direct_io(self) -> bool:
        """Whether files are opened with ``O_DIRECT``."""
        return self._direct

    def read_into(self, path: str | os.PathLike[str], out: torch.Tensor, offset: int = 0, *,
                  missing_ok: bool = False) -> concurrent.futures.Future[int]:
        """Fill all of ``out``'s bytes from ``path`` starting at byte ``offset``.

        Args:
            path: The file.
            out: Contiguous CPU tensor (any dtype); it receives ``out.nbytes`` bytes.
            offset: Byte position in the file.
            missing_ok: If the file does not exist, zero ``out`` and return 0 instead of
                raising ``FileNotFoundError``.

        Returns:
            A future of the number of bytes read (``out.nbytes``, or 0 for a missing file).
            It raises ``ValueError`` if the file ends before ``out`` is full, or the ``OSError``.

        Raises:
            TypeError: ``out`` is not a tensor.
            ValueError: ``out`` is not a contiguous CPU tensor, ``offset`` is negative, or
                (with ``direct_io``) they are not aligned.
            RuntimeError: The object is closed.
        """
        out, offset = self._check_operand(out, offset, "out")
        return self._submit(self._read, os.fsdecode(path), out, offset, bool(missing_ok))

    def write_from(self, path: str | os.PathLike[str], src: torch.Tensor, offset: int = 0
                   ) -> concurrent.futures.Future[int]:
        """Write ``src``'s bytes into ``path`` at byte ``offset``, in place.

        The file is created (mode 0600) if missing and never truncated, so rewriting a file of
        the same size reuses its pages. Nothing is fsynced: not for data that must survive a
        crash (use :class:`~colossal.core.io.AsyncTensorWriter` for that).

        Returns:
            A future of the number of bytes written (``src.nbytes``); it raises the ``OSError``.

        Raises:
            TypeError: ``src`` is not a tensor.
            ValueError: ``src`` is not a contiguous CPU tensor, ``offset`` is negative, or
                (with ``direct_io``) they are not aligned.
            RuntimeError: The object is closed.
        """
        src, offset = self._check_operand(src, offset, "src")
        return self._submit(self._write, os.fsdecode(path), src, offset)

    def release(self, path: str | os.PathLike[str]) -> concurrent.futures.Future[None]:
        """Close the kept-open file ``path`` (after the operations submitted before)."""
        return self._submit(self._release, os.fsdecode(path))

    def close(self, wait: bool = True) -> None:
        """Finish (``wait=True``) or cancel pending operations, then close every file.

        Idempotent; called at interpreter exit for pending work (the loop is drained).
        """
        with self._close_lock:
            self._loop_thread.close(wait=wait)
            self._executor.shutdown(wait=True, cancel_futures=True)
            files, self._files = self._files, {}
        for fd, _ in files.values():  # the IO thread has stopped: nothing else uses them
            os.close(fd)

    def __enter__(self) -> TensorFileIO:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close(wait=True)

    def _check_operand(self, tensor: object, offset: object, what: str) -> tuple[torch.Tensor, int]:
        """The validated tensor and offset of a read or write (aligned with ``direct_io``)."""
        checked, position = _check_tensor(tensor, what), _check_offset(offset)
        if self._direct:
            _check_aligned(checked, position, what)
        return checked, position

    # ---- on the loop thread -----------------------------------------------------------------
    def _submit(self, job: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        return self._loop_thread.submit(_run(job, *args, executor=self._executor))

    # ---- on the IO thread (one thread: no locking needed) -----------------------------------
    def _fd(self, path: str, writable: bool) -> tuple[int, bool]:
        """An open descriptor for ``path`` and whether to close it after the operation."""
        cached = self._files.get(path)
        if cached is not None and (cached[1] or not writable):
            return cached[0], False
        if cached is not None:  # opened read-only before: reopen for writing
            os.close(self._files.pop(path)[0])
        flags = (os.O_RDWR | os.O_CREAT) if writable else os.O_RDONLY
        if self._direct:
            flags |= os.O_DIRECT
        fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0), 0o600)
        if not self._keep_open:
            return fd, True
        self._files[path] = (fd, writable)
        return fd, False

    def _read(self, path: str, out: torch.Tensor, offset: int, missing_ok: bool) -> int:
        try:
            fd, close_after = self._fd(path, writable=False)
        except FileNotFoundError:
            if not missing_ok:
                raise
            out.zero_()
            return 0
        view = tensor_memoryview(out)
        try:
            done = 0
            while done < len(view):
                got = _pread(fd, view[done:], offset + done)
                done += got
                # A direct read is short only at the end of the file (and must not go on from
                # an unaligned position).
                if not got or (self._direct and done < len(view)):
                    raise ValueError(
                        f"{path}: file ended after {offset + done} bytes while reading "
                        f"{len(view)} bytes at offset {offset}; file truncated?"
                    )
            return done
        finally:
            view.release()
            if close_after:
                os.close(fd)

    def _write(self, path: str, src: torch.Tensor, offset: int) -> int:
        fd, close_after = self._fd(path, writable=True)
        view = tensor_memoryview(src)
        try:
            done = 0
            while done < len(view):
                done += _pwrite(fd, view[done:], offset + done)
            return done
        finally:
            view.release()
            if close_after:
                os.close(fd)

    def _release(self, path: str) -> None:
        cached = self._files.pop(path, None)
        if cached is not None:
            os.close(cached[0])


def _pread(fd: int, view: memoryview, offset: int) -> int:
    if hasattr(os, "preadv"):
        return os.preadv(fd, [view], offset)
    os.lseek(fd, offset, os.SEEK_SET)
    return os.readv(fd, [view])


def _pwrite(fd: int, view: memoryview, offset: int) -> int:
    if hasattr(os, "pwritev"):
        return os.pwritev(fd, [view], offset)
    os.lseek(fd, offset, os.SEEK_SET)
    return os.write(fd, view)


async def _run(job: Callable[..., T], *args: Any, executor: concurrent.futures.Executor) -> T:
    # One executor call per operation, submitted at the coroutine's first step: coroutines
    # start in submission order and the executor has one thread, so operations run in
    # submission order and back to back (no event-loop round trip between them).
    return await aiofiles.os.wrap(job)(*args, executor=executor)


_DEFAULT_LOCK = threading.Lock()
_default_io: TensorFileIO | None = None


def _shared() -> TensorFileIO:
    global _default_io
    with _DEFAULT_LOCK:
        if _default_io is None or _default_io._loop_thread._unusable_reason() is not None:
            _default_io = TensorFileIO()
        return _default_io


def read_tensor_file_async(path: str | os.PathLike[str], out: torch.Tensor, offset: int = 0
                           ) -> concurrent.futures.Future[int]:
    """Fill ``out`` from ``path`` in the background; see :meth:`TensorFileIO.read_into`."""
    return _shared().read_into(path, out, offset)


def write_tensor_file_async(path: str | os.PathLike[str], src: torch.Tensor, offset: int = 0
                            ) -> concurrent.futures.Future[int]:
    """Write ``src`` into ``path`` in the background; see :meth:`TensorFileIO.write_from`."""
    return _shared().write_from(path, src, offset)
