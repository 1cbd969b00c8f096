"""Optimizer state kept in a file, read ahead and written back in the background.

The offloaded params' ``exp_avg`` and ``exp_avg_sq`` (fp32) live in one file, laid out in
units of about the same size (:mod:`._nvme_layout`); each unit is read and written by one IO
call. When the filesystem allows it the file is opened with ``O_DIRECT``: the state moves
between RAM and the device by DMA, so it really leaves memory (not parked in the page cache)
and the IO costs almost no CPU time, leaving the cores to the Adam kernel. Buffered IO (the
fallback) copies every byte through the page cache on the CPU, which competes with the update
on a machine with few cores. During a step, :class:`StatePipeline` reads the next few units
into a small ring of reusable buffers while the current one updates, and writes each updated
unit back as soon as its update is done. The file IO goes through core's aiofiles tensor IO
(:class:`colossal.core.io.TensorFileIO`), which runs operations in submission order on one IO
thread, so a buffer is never refilled before its previous contents are written out and a unit
is never read before its last write finished. The file stays open between steps and is read
into / written from the buffers' memory without copies.

The file lives in a fresh temporary directory that is removed by :meth:`NVMeStateStore.close`,
when the store is garbage-collected, and at interpreter exit.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import torch

from colossal.core import get_logger
from colossal.core.io import TensorFileIO, direct_io_supported, empty_aligned
from colossal.kernels.optim._nvme_layout import Piece, StateLayout, Unit, padded

logger = get_logger(__name__)

UNIT_NUMEL = 16 * 1024 * 1024
"""Default fp32 values per unit (64 MiB: ``exp_avg`` and ``exp_avg_sq`` of 8Mi elements).

Each IO call costs a fixed overhead beyond its transfer (thread hand-offs), so fewer, larger
units are faster: two 64 MiB buffers (128 MiB) rather than three of 32 MiB (96 MiB). The
measurements are in colossal-kernels' CHANGELOG.
"""

DEPTH = 2
"""Unit buffers in the ring: one updating while the next is read."""

States = Mapping[int, tuple[torch.Tensor, torch.Tensor]]
Read = concurrent.futures.Future[Any] | None  # None: a unit never written (zeros)
LoadedPiece = tuple[Piece, torch.Tensor, torch.Tensor]  # (piece, exp_avg, exp_avg_sq views)


def _cleanup(directory: str, io: TensorFileIO) -> None:
    io.close(wait=True)
    shutil.rmtree(directory, ignore_errors=True)


class NVMeStateStore:
    """A file holding offloaded optimizer states, with asynchronous unit reads and writes.

    Args:
        directory: Parent directory of the temporary directory (``None``: the system temp
            directory). Created if missing.
        direct_io: Bypass the page cache with ``O_DIRECT``: ``None`` when the filesystem
            supports it, ``True`` to require it, ``False`` for buffered IO.
        unit_numel: fp32 values per unit (one IO call; the ring buffers hold a few units);
            ``None``: :data:`UNIT_NUMEL`.

    Raises:
        ValueError: ``directory`` exists and is not a directory, or ``direct_io=True`` and
            its filesystem refuses ``O_DIRECT``.
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None,
                 direct_io: bool | None = None, unit_numel: int | None = None) -> None:
        if directory is not None:
            directory = os.fspath(directory)
            if os.path.exists(directory) and not os.path.isdir(directory):
                raise ValueError(
                    f"nvme_offload_dir={directory!r} is not a directory; pass a directory on "
                    "the fast local disk (or None for the system temp directory)"
                )
            os.makedirs(directory, exist_ok=True)
        self.layout = StateLayout(unit_numel or UNIT_NUMEL)
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
        self.path = os.path.join(self.directory, "state.bin")
        self._io = TensorFileIO(keep_open=True, name="colossal-nvme", direct_io=self.direct_io)
        self._pending: list[concurrent.futures.Future[Any]] = []
        self._buffers: list[torch.Tensor] = []
        self._prefetch: tuple[tuple[int, ...], list[Read]] | None = None
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
        """Whether :meth:`close` ran (the file is gone)."""
        return self._closed

    def add(self, key: int, numel: int) -> None:
        """Give param ``key`` (``numel`` elements) a place in the file; its state reads as 0."""
        self._prefetch = None  # the buffers may grow
        self.layout.add(key, numel)

    def set_prefetched(self, units: Sequence[Unit], reads: list[Read]) -> None:
        """Record reads of ``units`` into buffer slots 0, 1, ... queued for the next step."""
        self._prefetch = (tuple(id(u) for u in units), reads)

    def take_prefetched(self, units: Sequence[Unit]) -> list[Read] | None:
        """The reads recorded by :meth:`set_prefetched` if they are of ``units``, else None."""
        prefetch, self._prefetch = self._prefetch, None
        if prefetch and prefetch[0] == tuple(id(u) for u in units):
            return prefetch[1]
        return None

    def _track(self, future: concurrent.futures.Future[Any]) -> concurrent.futures.Future[Any]:
        self._pending = [f for f in self._pending if not f.done() or f.exception()]
        self._pending.append(future)
        return future

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the NVMe state store is closed; its file was removed")

    def read_async(self, unit: Unit, out: torch.Tensor) -> concurrent.futures.Future[Any] | None:
        """Fill ``out`` (aligned, ``padded(unit.numel)`` values) with ``unit`` in the background.

        Returns ``None`` for a unit never written: there is nothing to read, its state is
        zeros (the caller fills them in, after any write still using ``out``).
        """
        self._check_open()
        if not unit.written:
            return None
        return self._track(self._io.read_into(self.path, out, unit.offset))

    def read(self, unit: Unit, out: torch.Tensor) -> None:
        """:meth:`read_async` and wait (zeros for a unit never written)."""
        future = self.read_async(unit, out)
        if future is None:
            out.zero_()
        else:
            future.result()

    def write_async(self, unit: Unit, src: torch.Tensor) -> concurrent.futures.Future[Any]:
        """Write ``src`` (aligned, ``padded(unit.numel)`` values) as ``unit``, in the background.

        Operations run in submission order, so a read submitted after this sees the data.
        """
        self._check_open()
        unit.written = True
        return self._track(self._io.write_from(self.path, src, unit.offset))

    def buffers(self, count: int) -> list[torch.Tensor]:
        """``count`` reusable aligned fp32 buffers, each large enough for any unit."""
        numel = max((padded(u.numel) for u in self.layout.units), default=0)
        if len(self._buffers) < count or self._buffers[0].numel() < numel:
            self.flush()
            self._prefetch = None  # it read into the old buffers
            self._buffers = [empty_aligned(numel) for _ in range(count)]
        return self._buffers[:count]

    def _loaded_units(self, keys: Collection[int]) -> Iterator[tuple[Unit, torch.Tensor,
                                                                      list[LoadedPiece]]]:
        """Each unit holding any of ``keys``, read into one scratch buffer.

        Yields the unit, its buffer and the pieces of ``keys`` with their views (after the
        queued IO is done).
        """
        self.flush()
        buf = empty_aligned(self.layout.capacity)
        for unit in self.layout.units_of(set(keys)):
            view = buf[: padded(unit.numel)]
            self.read(unit, view)
            yield unit, view, [(p, *piece_views(buf, p)) for p in unit.pieces if p.key in keys]

    def read_states(self, keys: Sequence[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """``{key: (exp_avg, exp_avg_sq)}`` (new flat fp32 tensors) of params ``keys``."""
        states = {k: (torch.empty(self._numel(k)), torch.empty(self._numel(k))) for k in keys}
        for _, _, pieces in self._loaded_units(states):
            for piece, m, v in pieces:
                exp_avg, exp_avg_sq = states[piece.key]
                exp_avg[piece.start : piece.stop] = m
                exp_avg_sq[piece.start : piece.stop] = v
        return states

    def write_states(self, states: States) -> None:
        """Store ``{key: (exp_avg, exp_avg_sq)}`` (any float CPU tensors) and wait."""
        self._prefetch = None  # what it read is stale now
        for unit, view, pieces in self._loaded_units(states):
            for piece, m, v in pieces:
                exp_avg, exp_avg_sq = states[piece.key]
                m.copy_(exp_avg.reshape(-1)[piece.start : piece.stop])
                v.copy_(exp_avg_sq.reshape(-1)[piece.start : piece.stop])
            self.write_async(unit, view).result()

    def _numel(self, key: int) -> int:
        return self.layout.pieces(key)[-1][1].stop

    def flush(self) -> None:
        """Wait for every queued read and write; re-raise the first IO error."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def close(self) -> None:
        """Wait for queued IO (errors are logged), then delete the file. Idempotent."""
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
        self._prefetch = None
        self._finalizer()


def piece_views(buf: torch.Tensor, piece: Piece) -> tuple[torch.Tensor, torch.Tensor]:
    """``(exp_avg, exp_avg_sq)`` of ``piece`` inside its unit's buffer ``buf``."""
    mid = piece.offset + piece.numel
    return buf[piece.offset : mid], buf[mid : mid + piece.numel]


class StatePipeline:
    """Streams the units of one step through a ring of buffers.

    Reads for the first ``depth`` units are queued on construction, so they overlap whatever
    the caller computes before iterating. Iterating yields ``(index, unit, buffer)`` with the
    unit loaded; when the caller asks for the next unit, the previous one is queued for
    writing and the read ``depth`` units ahead is queued. After the last unit, the first
    ``depth - 1`` units are read again for the next step (behind this step's writes, so they
    see the updates): that IO overlaps the next forward and backward, and the next pipeline
    over the same units starts with them loaded.

    Args:
        store: The store holding the file.
        units: The units to update, in file order.
        depth: Number of buffers (reads in flight).
        before_wait: Called with ``i`` before waiting for unit ``i``'s read (the caller
            interleaves in-memory updates there so they overlap the IO).
    """

    def __init__(self, store: NVMeStateStore, units: Sequence[Unit], depth: int = DEPTH,
                 before_wait: Callable[[int], None] | None = None) -> None:
        self.store = store
        self.before_wait = before_wait
        self.units = list(units)
        self.depth = max(1, min(depth, len(self.units)))
        self._slots = store.buffers(self.depth) if self.units else []
        self._reads: dict[int, Read] = {}
        self.waited = 0.0  # seconds the iteration blocked on reads
        # The last step read the first depth - 1 units ahead (one slot stays free, so the IO
        # thread has the next read to do at once).
        prefetched = store.take_prefetched(self.units[: self.depth - 1])
        self._reads = dict(enumerate(prefetched or []))
        for i in range(len(self._reads), self.depth):
            self._queue_read(i)

    def _buffer(self, i: int) -> torch.Tensor:
        return self._slots[i % self.depth][: padded(self.units[i].numel)]

    def _queue_read(self, i: int) -> None:
        if i < len(self.units):
            self._reads[i] = self.store.read_async(self.units[i], self._buffer(i))

    def __iter__(self) -> Iterator[tuple[int, Unit, torch.Tensor]]:
        for i, unit in enumerate(self.units):
            if self.before_wait is not None:
                self.before_wait(i)  # in-memory work that overlaps the read
            start = time.perf_counter()
            read = self._reads.pop(i)
            buf = self._buffer(i)
            if read is not None:
                read.result()
            else:  # never written: zeros, once queued writes (of any step) are done with buf
                self.store.flush()
                buf.zero_()
            self.waited += time.perf_counter() - start
            yield i, unit, buf
            self.store.write_async(unit, buf)
            self._queue_read(i + self.depth)
        ahead = self.units[: self.depth - 1]
        self.store.set_prefetched(
            ahead, [self.store.read_async(u, self._buffer(i)) for i, u in enumerate(ahead)]
        )
