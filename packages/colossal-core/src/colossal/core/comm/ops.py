"""Collective and point-to-point helpers that every Colossal package communicates through.

They are thin wrappers over :mod:`torch.distributed` that (1) report each call to the active
:class:`~colossal.core.comm.tracker.CommTracker` objects and (2) turn backend failures and
timeouts into a :class:`~colossal.core.comm.errors.CommError` naming the rank, the collective
and the group. Ranks given as ``src``/``dst``/``peer`` are global ranks, as in torch.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from colossal.core.comm.errors import comm_guard, require_initialized
from colossal.core.comm.tracker import GroupKey, record

_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


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
        self, work: Any, kind: str, group: GroupKey, on_done: Callable[[], None] | None = None
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

    def get_future(self) -> Any:
        """The underlying ``torch.futures.Future``."""
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


ALGORITHMS = ("auto", "native", "all_reduce")


def _emulate_with_all_reduce(algorithm: str, group: ProcessGroup | None) -> bool:
    """Whether to build reduce-scatter / all-gather from one all-reduce.

    gloo's native reduce-scatter and all-gather take about 1.8x the time of an all-reduce of
    the same tensor, so on gloo ("auto") both are done with a single all-reduce instead.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if algorithm == "auto":
        return dist.get_backend(group) == "gloo"
    return algorithm == "all_reduce"


def all_reduce(
    tensor: torch.Tensor,
    op: ReduceOp.RedOpType = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> CommWork | None:
    """Reduce ``tensor`` in place across ``group``."""
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


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,  # noqa: A002 - torch's own name
    op: ReduceOp.RedOpType = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    algorithm: str = "auto",
) -> CommWork | None:
    """Reduce the flat ``input`` across ``group`` and keep this rank's equal slice in ``output``.

    The contents of ``input`` are unspecified afterwards: on gloo (``algorithm="auto"`` or
    ``"all_reduce"``) it is all-reduced in place and this rank's slice copied out, which is
    faster there than gloo's native reduce-scatter. ``"native"`` forces the backend's own.

    Raises:
        ValueError: ``input`` does not hold exactly ``group size`` slices of ``output``'s size,
            or an unknown ``algorithm``.
    """
    key = group_ranks(group)
    size = len(key)
    if input.numel() != output.numel() * size:
        raise ValueError(
            f"reduce_scatter: input has {input.numel()} elements but the group of {size} ranks "
            f"needs {size} x output ({output.numel()}) = {size * output.numel()}; pad the input"
        )
    if not _emulate_with_all_reduce(algorithm, group):
        return _run(
            "reduce_scatter",
            group,
            _nbytes(input),
            _dtype(input),
            lambda: _reduce_scatter_flat(output, input, op=op, group=group, async_op=async_op),
            async_op,
        )
    start = key.index(dist.get_rank()) * output.numel()
    flat_in, flat_out = input.view(-1), output.view(-1)

    def copy_slice() -> None:
        flat_out.copy_(flat_in[start : start + flat_out.numel()])

    return _run(
        "reduce_scatter",
        group,
        _nbytes(input),
        _dtype(input),
        lambda: dist.all_reduce(flat_in, op=op, group=group, async_op=async_op),
        async_op,
        copy_slice,
    )


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,  # noqa: A002 - torch's own name
    group: ProcessGroup | None = None,
    async_op: bool = False,
    algorithm: str = "auto",
) -> CommWork | None:
    """Gather every rank's equal-size ``input`` into the flat ``output`` (rank order).

    On gloo (``algorithm="auto"`` or ``"all_reduce"``) ``output`` is zeroed, this rank's slice
    written and the whole summed with one all-reduce, faster there than gloo's native
    all-gather; the values are exact (adding zeros), except that ``-0.0`` arrives as ``0.0``.
    ``input`` may be a view into ``output``. ``"native"`` forces the backend's own.

    Raises:
        ValueError: ``output`` does not hold exactly ``group size`` copies of ``input``'s size,
            or an unknown ``algorithm``.
    """
    key = group_ranks(group)
    size = len(key)
    if output.numel() != input.numel() * size:
        raise ValueError(
            f"all_gather: output has {output.numel()} elements but the group of {size} ranks "
            f"gathers {size} x input ({input.numel()}) = {size * input.numel()}; gloo cannot "
            "gather uneven sizes, pad the inputs to equal size"
        )
    if not _emulate_with_all_reduce(algorithm, group):
        return _run(
            "all_gather",
            group,
            _nbytes(output),
            _dtype(output),
            lambda: _all_gather_flat(output, input, group=group, async_op=async_op),
            async_op,
        )
    start = key.index(dist.get_rank()) * input.numel()
    flat_out = output.view(-1)
    n = input.numel()
    target = flat_out[start : start + n]
    in_place = input.is_contiguous() and input.data_ptr() == target.data_ptr()
    mine = (
        input.reshape(-1).clone()
        if not in_place and _overlaps(input, output)
        else input.reshape(-1)
    )
    flat_out[:start].zero_()
    flat_out[start + n :].zero_()
    if not in_place:
        target.copy_(mine)
    return _run(
        "all_gather",
        group,
        _nbytes(output),
        _dtype(output),
        lambda: dist.all_reduce(flat_out, group=group, async_op=async_op),
        async_op,
    )


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1, b1 = a0 + _nbytes(a), b0 + _nbytes(b)
    return a0 < b1 and b0 < a1


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
    """Wait until every rank of ``group`` reaches this point."""
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


def all_gather_object(obj: Any, group: ProcessGroup | None = None) -> list[Any]:
    """Gather a picklable object from every rank of ``group`` (rank order)."""
    key = group_ranks(group)
    out: list[Any] = [None] * len(key)
    record("all_gather_object", key, len(pickle.dumps(obj)), "object")
    with comm_guard("all_gather_object", key):
        dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, src: int, group: ProcessGroup | None = None) -> Any:
    """Broadcast a picklable object from global rank ``src``; every rank returns it."""
    key = group_ranks(group)
    box = [obj]
    record(
        "broadcast_object", key, len(pickle.dumps(obj)) if dist.get_rank() == src else 0, "object"
    )
    with comm_guard("broadcast_object", key):
        dist.broadcast_object_list(box, src=src, group=group)
    return box[0]
