"""Reduce-scatter and all-gather through shared memory, for groups whose ranks share a host.

gloo moves every byte through a TCP socket on the loopback device, twice copied by the
kernel. Ranks on one host can instead write their piece into a shared slot and read their
peers' slots directly. :class:`ShmChannel` maps one file in ``/dev/shm`` per group (one slot
per rank, two buffers each so that one synchronization per piece suffices) and a line of
sequence counters. A rank publishes a piece by bumping its counter and reads once every
rank's counter reached the same value; large tensors go in pieces of the slot's size.

The file is unlinked as soon as every rank has mapped it (nothing is left behind by a
crash). A rank that does not arrive within the group's timeout makes the others raise
(a :class:`~colossal.core.comm.CommError` from the collective) instead of waiting forever.
The counters rely on the stores of one process becoming visible to the others in program
order (x86-64 and other total-store-order machines); elsewhere :func:`supported` is False
and gloo is used. ``COLOSSAL_SHM_COMM=0`` turns shared memory off.
"""

from __future__ import annotations

import contextlib
import os
import platform
import time
import uuid

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from colossal.core.comm.ops import group_ranks

__all__ = ["ShmChannel", "available", "channel", "supported"]

SLOT_BYTES = 4 * 1024**2  # per rank and buffer (a group of W ranks maps 8 W MB)
_LINE = 64  # bytes per counter: one cache line each, no false sharing
_YIELD_S = 50e-6
"""A waiting rank yields the core this long, then sleeps (backing off from ``_NAP_S``).

Spinning, even yielding at every check, keeps a rank runnable: with more ranks than cores (4 on
2) it takes the core from the late rank it waits for, so waits that yield at every check cost
more CPU per step than gloo (measured: colossal-core's CHANGELOG); pieces of one collective
(all ranks in the same loop) arrive within the yield phase.
"""
_NAP_S = (20e-6, 500e-6)  # first and longest sleep
_DIR = "/dev/shm"
_PREFIX = "colossal-comm-"  # then the creator's pid and a random suffix
_channels: dict[ProcessGroup, ShmChannel | None] = {}


def supported() -> bool:
    """Whether this machine can run shared-memory collectives (Linux, x86-64, /dev/shm)."""
    return (
        platform.system() == "Linux"
        and platform.machine() in ("x86_64", "AMD64")
        and os.path.isdir(_DIR)
        and os.environ.get("COLOSSAL_SHM_COMM", "1") != "0"
    )


class ShmChannel:
    """Shared slots of the ranks of ``group`` (all on this host).

    Args:
        group: The process group (its ranks must share this host).
        ranks: The group's global ranks, in group order.
        slot_bytes: Bytes per rank and buffer.
        timeout: Seconds to wait for the slowest rank before raising ``CommError``.
    """

    def __init__(
        self,
        group: ProcessGroup | None,
        ranks: tuple[int, ...],
        slot_bytes: int = SLOT_BYTES,
        timeout: float = 300.0,
    ) -> None:
        self.ranks = ranks
        self.size = len(ranks)
        self.position = ranks.index(dist.get_rank())
        self.slot_bytes = slot_bytes
        self.timeout = timeout
        header = _LINE * self.size
        total = header + 2 * self.size * slot_bytes
        raw = _map_shared(group, ranks, total)
        if raw is None:
            raise OSError("the group's ranks do not share /dev/shm")
        self._counters = raw[:header].view(torch.int64)[:: _LINE // 8]
        self._view = self._counters.numpy()
        self._slots = raw[header:].view(2, self.size, slot_bytes)
        self._seq = 0

    def _publish_and_wait(self) -> None:
        """Announce this rank's piece and wait until every rank announced the same one."""
        self._seq += 1
        seq = self._seq
        counters = self._view  # numpy: a cheaper check than a torch reduction
        self._counters[self.position] = seq
        if counters.min() >= seq:
            return
        start = time.monotonic()
        nap = _NAP_S[0]
        while counters.min() < seq:
            now = time.monotonic()
            if now - start < _YIELD_S:
                os.sched_yield()
                continue
            if now - start > self.timeout:
                late = [r for r, c in zip(self.ranks, counters.tolist(), strict=True) if c < seq]
                raise RuntimeError(  # the caller's comm_guard names rank and collective
                    f"shared memory: ranks {late} did not arrive within "
                    f"{self.timeout:.0f}s (set COLOSSAL_SHM_COMM=0 to use gloo instead)"
                )
            time.sleep(nap)
            nap = min(2 * nap, _NAP_S[1])

    def _buffer(self, dtype: torch.dtype) -> torch.Tensor:
        """This piece's buffer of every rank, as ``(size, slot elements)`` of ``dtype``."""
        return self._slots[(self._seq + 1) % 2].view(dtype)

    def reduce_scatter(self, output: torch.Tensor, flat_in: torch.Tensor) -> None:
        """Sum ``flat_in`` (``size`` slices of ``output.numel()``) over ranks; keep ours."""
        n = output.numel()
        out = output.view(-1)
        per = self.slot_bytes // (flat_in.element_size() * self.size)
        segments = flat_in.view(self.size, n)
        for lo in range(0, n, per):
            hi = min(n, lo + per)
            m = hi - lo
            buf = self._buffer(flat_in.dtype)
            buf[self.position, : self.size * m].view(self.size, m).copy_(segments[:, lo:hi])
            self._publish_and_wait()
            mine = buf[:, : self.size * m].view(self.size, self.size, m)[:, self.position]
            torch.sum(mine, dim=0, out=out[lo:hi])

    def barrier(self) -> None:
        """Wait until every rank of the group reaches this point."""
        self._publish_and_wait()

    def all_reduce(self, flat: torch.Tensor) -> None:
        """Sum ``flat`` over ranks in place; every rank adds in rank order (equal results)."""
        n = flat.numel()
        per = self.slot_bytes // flat.element_size()
        for lo in range(0, n, per):
            hi = min(n, lo + per)
            buf = self._buffer(flat.dtype)
            buf[self.position, : hi - lo].copy_(flat[lo:hi])
            self._publish_and_wait()
            torch.sum(buf[:, : hi - lo], dim=0, out=flat[lo:hi])

    def all_gather(self, flat_out: torch.Tensor, flat_in: torch.Tensor) -> None:
        """Gather every rank's ``flat_in`` into ``flat_out`` (rank order)."""
        n = flat_in.numel()
        per = self.slot_bytes // flat_in.element_size()
        dest = flat_out.view(self.size, n)
        for lo in range(0, n, per):
            hi = min(n, lo + per)
            buf = self._buffer(flat_in.dtype)
            buf[self.position, : hi - lo].copy_(flat_in[lo:hi])
            self._publish_and_wait()
            # The other ranks' pieces from the buffer, ours straight from the input (often
            # the same memory as its place in the output: then nothing to copy).
            me = self.position
            dest[:me, lo:hi].copy_(buf[:me, : hi - lo])
            dest[me + 1 :, lo:hi].copy_(buf[me + 1 :, : hi - lo])
            if dest[me, lo:hi].data_ptr() != flat_in[lo:hi].data_ptr():
                dest[me, lo:hi].copy_(flat_in[lo:hi])


def _map_shared(
    group: ProcessGroup | None, ranks: tuple[int, ...], total: int
) -> torch.Tensor | None:
    """Map one new ``/dev/shm`` file of ``total`` bytes on every rank; None where one cannot."""
    first = ranks.index(dist.get_rank()) == 0
    names: list[str | None] = [None]
    if first:
        names[0] = _create(total)
    try:
        dist.broadcast_object_list(names, src=ranks[0], group=group)
        path = names[0]
        if path is None:
            return None  # no room in /dev/shm
        raw: torch.Tensor | None = None
        if os.path.exists(path):  # else another host's /dev/shm (mapping would create a file)
            try:
                raw = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
            except (OSError, RuntimeError):
                raw = None
        mapped: list[bool | None] = [None] * len(ranks)
        dist.all_gather_object(mapped, raw is not None, group=group)
    finally:
        if first and names[0] is not None:  # all have mapped it, given up or failed
            os.unlink(names[0])
    return raw if all(mapped) else None


def _remove_orphans() -> None:
    """Unlink files left by creators that died between creating and unlinking them."""
    for name in os.listdir(_DIR):
        if not name.startswith(_PREFIX):
            continue
        pid = name[len(_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(_DIR, name))


def _create(total: int) -> str | None:
    """A new ``/dev/shm`` file with ``total`` bytes reserved, or None when there is no room.

    Reserving up front turns a full ``/dev/shm`` (64 MB in a default container) into a
    fallback to gloo here instead of a SIGBUS at the first write.
    """
    _remove_orphans()
    path = os.path.join(_DIR, f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, total)
    except OSError:
        os.close(fd)
        os.unlink(path)
        return None
    os.close(fd)
    return path


def _timeout_of(group: ProcessGroup) -> float:
    """The group's collective timeout in seconds (what gloo would wait), else 300."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return 300.0


def channel(group: ProcessGroup | None, ranks: tuple[int, ...]) -> ShmChannel | None:
    """The shared-memory channel of ``group``, or None when its ranks do not share /dev/shm.

    Collective on the first call for a group (each of its ranks must make it at the same
    point of the program). Each group has its own channel: operations are matched by their
    order within one group, as gloo matches them, never across groups.
    """
    key = group if group is not None else dist.group.WORLD
    if key is None:
        raise RuntimeError("torch.distributed is not initialized: call init_process_group first")
    if key not in _channels:
        try:
            _channels[key] = ShmChannel(group, ranks, timeout=_timeout_of(key))
        except OSError:
            _channels[key] = None
    return _channels[key]


def available(group: ProcessGroup | None, tensor: torch.Tensor) -> bool:
    """Whether synchronous reduce-scatters and all-gathers of ``tensor`` use shared memory.

    True for gloo groups of two or more ranks on this host and CPU tensors.

    Collective on the first call for a group. Callers that would issue an asynchronous
    operation can issue a synchronous one instead when this is True: it is faster than
    gloo's even without overlap.
    """
    if len(group_ranks(group)) < 2 or tensor.device.type != "cpu" or not supported():
        return False
    if tensor.dtype == torch.bool or dist.get_backend(group) != "gloo":
        return False
    return channel(group, group_ranks(group)) is not None
