"""Streaming a safetensors file tensor by tensor while the tensors are still being gathered.

:func:`stream_part` gathers a file's tensors for its writer (every rank, one order) and the
writer hands each to :class:`StreamFile`, whose thread checksums and writes it while the
next one is gathered: one tensor in flight, so a file of any size costs about one tensor of
memory. The file carries its final name only once complete and durable.
"""

from __future__ import annotations

import os
import queue
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence

import torch

from colossal.checkpoint_io import durable
from colossal.checkpoint_io.checksum import crc32
from colossal.checkpoint_io.index import CheckpointError
from colossal.checkpoint_io.inplace import file_layout, stream_order
from colossal.checkpoint_io.sharded import TensorLike
from colossal.core.io import tensor_memoryview

__all__ = ["StreamFile", "Streamed", "stream_part"]


class Streamed:
    """A file :func:`stream_part` wrote (already durable): its path and CRC-32."""

    def __init__(self, path: str, crc32: str) -> None:
        self.path, self.crc32 = path, crc32

    def wait(self) -> str:
        """The path (the file is complete)."""
        return self.path


def stream_part(
    tensors: Mapping[str, TensorLike],
    names: list[str],
    writer: int,
    rank: int,
    target: str,
    gather: Callable[[TensorLike, int], torch.Tensor | None],
) -> Streamed | None:
    """Gather ``names`` for ``writer`` (every rank, one order); the writer streams the file.

    The order is by decreasing element size (every tensor aligned to its element size), then
    the plan's order: the same on every rank, and chunk by chunk for chunked tensors.
    """
    ordered = stream_order(tensors, names)
    stream = StreamFile(target, [(n, tensors[n].shape, tensors[n].dtype) for n in ordered]) \
        if writer == rank else None
    try:
        for name in ordered:
            full = gather(tensors[name], writer)  # may be collective: every rank, in order
            if stream is not None:
                assert full is not None
                stream.put(name, full)
            del full
    except BaseException:
        if stream is not None:
            stream.abort()
        raise
    return stream.finish() if stream is not None else None


class StreamFile:
    """One safetensors file written tensor by tensor, crash-safely, by a writer thread.

    The header (from the declared shapes and dtypes) goes to a hidden temporary file next to
    ``target``; :meth:`put` waits until the previous tensor is written, then hands the next one
    to the thread (which checksums, writes and drops it while the caller gathers the one after:
    one tensor in flight); :meth:`finish` fsyncs, renames the file onto
    ``target`` and fsyncs the directory. A failed or aborted write removes the temporary file,
    so nothing incomplete ever carries the final name.
    """

    def __init__(
        self, target: str, entries: list[tuple[str, Sequence[int], torch.dtype]]
    ) -> None:
        header, infos = file_layout(entries)
        self.target, self._infos, self._next = target, infos, 0
        directory = os.path.dirname(os.path.abspath(target))
        name = os.path.basename(target)[:200]
        self._tmp = os.path.join(directory, f".{name}.{uuid.uuid4().hex[:12]}.tmp")
        self._file = open(self._tmp, "wb")  # noqa: SIM115 - closed by finish()/abort()
        self._file.write(header)
        self._crc = crc32(header)
        self._error: BaseException | None = None
        self._queue: queue.Queue[torch.Tensor | None] = queue.Queue(maxsize=1)
        self._thread = threading.Thread(target=self._run, name="colossal-ckpt-stream",
                                        daemon=True)
        self._thread.start()

    def put(self, name: str, tensor: torch.Tensor) -> None:
        """Queue the next tensor (it must be the next entry, with its shape and dtype).

        Raises:
            CheckpointError: ``tensor`` is not the entry the header declares next.
        """
        info = self._infos[self._next] if self._next < len(self._infos) else None
        if info is None or info.name != name or tuple(tensor.shape) != info.shape \
                or tensor.dtype != info.dtype:
            raise CheckpointError(
                f"{name!r} ({tuple(tensor.shape)}, {tensor.dtype}) is not what {self.target} "
                f"declares next ({info}); a sharded tensor gathered to another shape or dtype "
                "than it reports"
            )
        self._next += 1
        self._queue.join()  # the previous tensor is written and dropped
        if self._error is not None:
            raise self._error
        self._queue.put(tensor.detach().to("cpu").contiguous())

    def _run(self) -> None:
        while True:
            data = self._queue.get()
            if data is None:
                self._queue.task_done()
                return
            if self._error is not None:
                del data
                self._queue.task_done()
                continue  # drain after a failure
            try:
                if data.numel():
                    view = tensor_memoryview(data)
                    self._crc = crc32(view, self._crc)
                    self._file.write(view)
            except BaseException as err:  # noqa: BLE001 - raised by put()/finish()
                self._error = err
            finally:
                del data
                self._queue.task_done()

    def _stop(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def finish(self) -> Streamed:
        """Wait for the writes, make the file durable and give it its final name."""
        try:
            self._stop()
            if self._error is not None:
                raise self._error
            if self._next != len(self._infos):
                raise CheckpointError(f"{self.target}: {len(self._infos) - self._next} "
                                      "tensors were never written")
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self._tmp, self.target)
        except BaseException:
            self.abort()
            raise
        durable.fsync_directory(os.path.dirname(os.path.abspath(self.target)))
        return Streamed(self.target, f"{self._crc & 0xFFFFFFFF:08x}")

    def abort(self) -> None:
        """Stop writing and remove the temporary file."""
        if self._thread.is_alive():
            self._error = self._error or CheckpointError("aborted")
            self._stop()
        self._file.close()
        try:
            os.remove(self._tmp)
        except FileNotFoundError:
            pass
