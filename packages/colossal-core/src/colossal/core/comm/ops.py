"""Collective and point-to-point helpers that every Colossal package communicates through.

They are thin wrappers over :mod:`torch.distributed` that (1) report each call to the active
:class:`~colossal.core.comm.tracker.CommTracker` objects and (2) turn backend failures and
timeouts into a :class:`~colossal.core.comm.errors.CommError` naming the rank, the collective
and the group. Ranks given as ``src``/``dst``/``peer`` are global ranks, as in torch.
"""

from __future__ import annotations

import ctypes
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from colossal.core.comm.errors import comm_guard, require_initialized
from colossal.core.comm.tracker import GroupKey, record

_T = TypeVar("_T")


def group_ranks(group: ProcessGroup | None = None) -> GroupKey:
    """Global ranks of ``group`` (the default group when ``None``)."""
    require_initialized()
    if group is None or group is dist.GroupMember.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


class CommWork:
    """An asynchronous operation's handle whose ``wait`` reports failures like the sync form."""

    def __init__(
        self,
        work: dist.Work,
        kind: str,
        group: GroupKey,
        on_done: Callable[[], None] | None = None,
    ) -> None:
        self._work = work
        self.kind = kind
        self.group = group
        self._on_done = on_done

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the operation is done; raise :class:`CommError` if it failed."""
        with comm_guard(self.kind, self.group):
            ok = self._work.wait() if timeout is None else self._work.wait(timeout)
        if self._on_done is not None:
            finish, self._on_done = self._on_done, None
            finish()
        return ok

    def is_completed(self) -> bool:
        """Whether the operation has finished."""
        return self._work.is_completed()

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        """The underlying future (its value: the operation's tensors)."""
        return self._work.get_future()


def _run(
    kind: str,
    group: ProcessGroup | None,
    nbytes: int,
    dtype: str,
    fn: Any,
    async_op: bool,
    on_done: Callable[[], None] | None = None,
) -> CommWork | None:
    key = group_ranks(group)
    record(kind, key, nbytes, dtype)
    with comm_guard(kind, key):
        work = fn()
    if async_op:
        return CommWork(work, kind, key, on_done)
    if on_done is not None:
        on_done()
    return None


_EMPTY = torch.empty(0, dtype=torch.uint8)


def _shm_channel(kind: str, group: ProcessGroup | None, tensor: torch.Tensor) -> Any:
    """The group's shared-memory channel for a synchronous ``kind`` of ``tensor``, or None."""
    from colossal.core.comm import shm  # here: shm builds on this module

    key = group_ranks(group)
    with comm_guard(kind, key):  # the first call for a group sets the channel up
        return shm.channel(group, key) if shm.available(group, tensor) else None


def all_reduce(
    tensor: torch.Tensor,
    op: ReduceOp.RedOpType = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> CommWork | None:
    """Reduce ``tensor`` in place across ``group``.

    A synchronous sum of a contiguous CPU tensor over ranks of one host goes through shared
    memory (:mod:`colossal.core.comm.shm`), else through the group's backend.
    """
    channel = (
        _shm_channel("all_reduce", group, tensor)
        if not async_op and op == ReduceOp.SUM and tensor.is_contiguous()
        else None
    )
    if channel is not None:
        return _run(
            "all_reduce", group, _nbytes(tensor), _dtype(tensor),
            lambda: channel.all_reduce(tensor.view(-1)), False,
        )
    return _run(
        "all_reduce",
        group,
        _nbytes(tensor),
        _dtype(tensor),
        lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op),
        async_op,
    )


def reduce(
    tensor: torch.Tensor,
    dst: int,
    op: ReduceOp.RedOpType = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> CommWork | None:
    """Reduce ``tensor`` onto global rank ``dst``."""
    return _run(
        "reduce",
        group,
        _nbytes(tensor),
        _dtype(tensor),
        lambda: dist.reduce(tensor, dst=dst, op=op, group=group, async_op=async_op),
        async_op,
    )


def broadcast(
    tensor: torch.Tensor, src: int, group: ProcessGroup | None = None, async_op: bool = False
) -> CommWork | None:
    """Broadcast ``tensor`` from global rank ``src`` to every rank of ``group``."""
    return _run(
        "broadcast",
        group,
        _nbytes(tensor),
        _dtype(tensor),
        lambda: dist.broadcast(tensor, src=src, group=group, async_op=async_op),
        async_op,
    )


def all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,  # noqa: A002 - torch's own name
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> CommWork | None:
    """Scatter slices of ``input`` to every rank and gather theirs into ``output``."""
    return _run(
        "all_to_all",
        group,
        _nbytes(input),
        _dtype(input),
        lambda: dist.all_to_all_single(
            output,
            input,
            output_split_sizes=output_split_sizes,
            input_split_sizes=input_split_sizes,
            group=group,
            async_op=async_op,
        ),
        async_op,
    )


def barrier(group: ProcessGroup | None = None) -> None:
    """Wait until every rank of ``group`` reaches this point.

    Through shared memory when the group's ranks share a host, else the backend's barrier.
    """
    channel = _shm_channel("barrier", group, _EMPTY)
    if channel is not None:
        _run("barrier", group, 0, "none", channel.barrier, False)
        return
    _run("barrier", group, 0, "none", lambda: dist.barrier(group=group), False)


def send(tensor: torch.Tensor, dst: int, group: ProcessGroup | None = None, tag: int = 0) -> None:
    """Send ``tensor`` to global rank ``dst`` (blocking)."""
    _run(
        "send",
        group,
        _nbytes(tensor),
        _dtype(tensor),
        lambda: dist.send(tensor, dst=dst, group=group, tag=tag),
        False,
    )


def recv(tensor: torch.Tensor, src: int, group: ProcessGroup | None = None, tag: int = 0) -> None:
    """Receive into ``tensor`` from global rank ``src`` (blocking)."""
    _run(
        "recv",
        group,
        _nbytes(tensor),
        _dtype(tensor),
        lambda: dist.recv(tensor, src=src, group=group, tag=tag),
        False,
    )


def isend(
    tensor: torch.Tensor, dst: int, group: ProcessGroup | None = None, tag: int = 0
) -> CommWork:
    """Start sending ``tensor`` to global rank ``dst``."""
    work = _run(
        "send",
        group,
        _nbytes(tensor),
        _dtype(tensor),
        lambda: dist.isend(tensor, dst=dst, group=group, tag=tag),
        True,
    )
    assert work is not None
    return work


def irecv(
    tensor: torch.Tensor, src: int, group: ProcessGroup | None = None, tag: int = 0
) -> CommWork:
    """Start receiving into ``tensor`` from global rank ``src``."""
    work = _run(
        "recv",
        group,
        _nbytes(tensor),
        _dtype(tensor),
        lambda: dist.irecv(tensor, src=src, group=group, tag=tag),
        True,
    )
    assert work is not None
    return work


@dataclass(frozen=True)
class P2POp:
    """One send or receive of a batch for :func:`batch_isend_irecv`.

    Attributes:
        op: ``"send"`` or ``"recv"``.
        tensor: The tensor to send, or the buffer to receive into.
        peer: Global rank of the other side.
        group: Process group (default group when ``None``).
        tag: Message tag.
    """

    op: str
    tensor: torch.Tensor
    peer: int
    group: ProcessGroup | None = None
    tag: int = 0

    def __post_init__(self) -> None:
        if self.op not in ("send", "recv"):
            raise ValueError(f"P2POp.op must be 'send' or 'recv', got {self.op!r}")


def batch_isend_irecv(ops: Sequence[P2POp]) -> list[CommWork]:
    """Start a batch of sends and receives together; wait on every returned handle."""
    if not ops:
        return []
    torch_ops = []
    for p in ops:
        record(p.op, group_ranks(p.group), _nbytes(p.tensor), _dtype(p.tensor))
        fn = dist.isend if p.op == "send" else dist.irecv
        torch_ops.append(dist.P2POp(fn, p.tensor, p.peer, group=p.group, tag=p.tag))
    key = group_ranks(ops[0].group)
    with comm_guard("batch_isend_irecv", key):
        works = dist.batch_isend_irecv(torch_ops)
    return [CommWork(w, "batch_isend_irecv", key) for w in works]


INLINE_OBJECT_BYTES = 4088
"""Pickles up to this size travel in :func:`all_gather_object`'s single round."""

_LENGTH = 8  # bytes of the length prefix of each rank's slot


def all_gather_object(obj: _T, group: ProcessGroup | None = None) -> list[_T]:
    """Gather a picklable object from every rank of ``group`` (rank order).

    One all-gather of fixed ``4 KiB`` slots (a length and the pickle) when every rank's pickle
    fits in :data:`INLINE_OBJECT_BYTES`; otherwise the ranks learn the lengths from that
    round and run a second one sized for the largest. torch's ``all_gather_object`` always
    takes two (the sizes, then the payloads): at world 4 on two cores each round costs
    several ms, and checkpoint saves agree on small objects a few times each.
    """
    key = group_ranks(group)
    data = pickle.dumps(obj)
    record("all_gather_object", key, len(data), "object")
    with comm_guard("all_gather_object", key):
        return [pickle.loads(b) for b in _gather_bytes(data, group, len(key))]  # noqa: S301


def _gather_bytes(data: bytes, group: ProcessGroup | None, size: int) -> list[bytes]:
    slot = INLINE_OBJECT_BYTES + _LENGTH
    mine = torch.zeros(slot, dtype=torch.uint8)
    mine[:_LENGTH] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
    if len(data) <= INLINE_OBJECT_BYTES:
        mine[_LENGTH : _LENGTH + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    slots = _gather_equal(mine, group, size)
    lengths = [int(s[:_LENGTH].view(torch.int64)) for s in slots]
    if max(lengths) <= INLINE_OBJECT_BYTES:
        return [_bytes_of(s[_LENGTH:], n) for s, n in zip(slots, lengths, strict=True)]
    longest = max(lengths)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    payloads = _gather_equal(padded, group, size)
    return [_bytes_of(p, n) for p, n in zip(payloads, lengths, strict=True)]


def _gather_equal(mine: torch.Tensor, group: ProcessGroup | None, size: int) -> list[torch.Tensor]:
    """Every rank's ``mine`` (equal sizes), through shared memory when the ranks share it."""
    channel = _shm_channel("all_gather_object", group, mine)
    if channel is not None:
        flat = torch.empty(size * mine.numel(), dtype=mine.dtype)
        channel.all_gather(flat, mine)
        return list(flat.view(size, -1))
    out = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(out, mine, group=group)
    return out


def _bytes_of(tensor: torch.Tensor, n: int) -> bytes:
    """The first ``n`` bytes of a contiguous CPU uint8 tensor (no numpy needed)."""
    return ctypes.string_at(tensor.data_ptr(), n) if n else b""


def broadcast_object(obj: _T, src: int, group: ProcessGroup | None = None) -> _T:
    """Broadcast a picklable object from global rank ``src``; every rank returns it.

    Every rank passes an object of the type ``src`` sends (a placeholder off ``src``).
    """
    key = group_ranks(group)
    box = [obj]
    record(
        "broadcast_object", key, len(pickle.dumps(obj)) if dist.get_rank() == src else 0, "object"
    )
    with comm_guard("broadcast_object", key):
        dist.broadcast_object_list(box, src=src, group=group)
    return box[0]
