"""Reduce-scatter and all-gather of flat tensors, with the algorithm chosen per backend.

On gloo, ``algorithm="auto"`` gathers with the *rooted* form (a broadcast rooted at each rank
for its slice) and sums-and-scatters around a *ring* of point-to-point messages, because
gloo's native reduce-scatter and all-gather are slower than them (and than one all-reduce);
other backends use their own. Synchronous calls on CPU tensors of ranks that share a host go
through shared memory instead (:mod:`colossal.core.comm.shm`, ``"shm"``). The measurements
are in colossal-core's CHANGELOG.
Whatever the algorithm, the comm tracker records one logical collective and its full size.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from colossal.core.comm import shm
from colossal.core.comm.errors import comm_guard
from colossal.core.comm.ops import CommWork, _dtype, _nbytes, _run, group_ranks

ALGORITHMS = ("auto", "native", "all_reduce", "rooted", "ring", "shm")

_RING_TAG = 0x5253  # p2p tag of the ring reduce-scatter's messages (apart from other sends)

_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _WorkList:
    """Several asynchronous operations waited on as one.

    :meth:`is_completed` tells the truth for gloo's point-to-point works too: they report
    ``False`` until something waits on them, however long ago their data arrived (and
    a ``wait`` with a timeout that expires closes the gloo pair, so it cannot be used to
    probe). The first poll that finds an unfinished work therefore hands the waits to a
    daemon thread (gloo's ``wait`` releases the GIL) and later polls read its flag; a
    ``wait`` after that joins the thread (each gloo work may be waited on once only: a second
    ``wait`` on a send blocks for the next send). Without polls no thread is started.
    """

    def __init__(self, works: Sequence[Any]) -> None:
        self._works = list(works)
        self._lock = threading.Lock()
        self._waiter: threading.Thread | None = None
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._direct = False  # waited on without the thread (it must then never start)

    def _wait_all(self) -> None:
        try:
            for work in self._works:
                work.wait()
        except BaseException as exc:  # noqa: BLE001 - re-raised by wait() in the caller
            self._error = exc
        finally:
            self._done.set()

    def wait(self, timeout: Any = None) -> bool:
        with self._lock:
            waiter = self._waiter
            direct = waiter is None and not self._direct
            self._direct = self._direct or direct
        if direct:
            for work in self._works:
                work.wait() if timeout is None else work.wait(timeout)
            self._done.set()
            return True
        if waiter is None:  # waited on directly before: done
            return True
        # The thread's waits carry the group's own timeout, so this join ends.
        waiter.join(None if timeout is None else timeout.total_seconds())
        if not self._done.is_set():
            raise TimeoutError(f"point-to-point works not finished within {timeout}")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        if self._done.is_set():
            return True
        with self._lock:
            if self._waiter is None and not self._direct:
                if all(w.is_completed() for w in self._works):
                    return True
                self._waiter = threading.Thread(
                    target=self._wait_all, name="colossal-comm-wait", daemon=True
                )
                self._waiter.start()
        return self._done.is_set()

    def get_future(self) -> Any:
        raise NotImplementedError("a rooted collective has no single future; call wait()")


def _choose(
    algorithm: str,
    group: ProcessGroup | None,
    gloo_default: str = "rooted",
    tensor: torch.Tensor | None = None,
    async_op: bool = True,
    kind: str = "",
) -> str:
    """The algorithm to run for ``algorithm`` (``"auto"`` resolved).

    ``"auto"`` takes shared memory for synchronous calls on CPU tensors when the group's
    ranks share a host. Never for asynchronous ones: they must not block, as the caller may
    issue other groups' collectives first (in another order on another rank).
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if algorithm != "auto":
        return algorithm
    if dist.get_backend(group) != "gloo":
        return "native"
    if not async_op and tensor is not None:
        with comm_guard(kind, group_ranks(group)):  # the first call sets shm up
            if shm.available(group, tensor):
                return "shm"
    return gloo_default


def _done_after(
    op: Callable[[torch.Tensor, torch.Tensor], None], out: torch.Tensor, inp: torch.Tensor
) -> _Done:
    """Run a blocking shared-memory collective; its work is then already complete."""
    op(out, inp)
    return _Done()


def _required_channel(group: ProcessGroup | None, key: tuple[int, ...]) -> shm.ShmChannel:
    """The group's shared-memory channel (``"shm"`` chosen or asked for explicitly)."""
    found = shm.channel(group, key)
    if found is None:
        raise ValueError("algorithm='shm' needs every rank of the group on this host")
    return found


class _Done:
    """The work of an emulated collective that completed before it was returned."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> Any:
        raise NotImplementedError("a ring collective completes synchronously; call wait()")


def _ring_reduce_scatter(
    flat: torch.Tensor, n: int, key: Sequence[int], group: ProcessGroup | None
) -> None:
    """Sum ``flat`` (``len(key)`` slices of ``n``) over the ring; this rank's slice ends reduced.

    Step ``s`` sends slice ``position - s - 1`` (holding ``s + 1`` ranks' sum) to the next rank
    and adds the previous rank's slice ``position - s - 2`` into this one's: after
    ``size - 1`` steps this rank's own slice holds every rank's sum. Each rank sends and
    receives ``(size - 1) / size`` of the tensor once, as a ring all-reduce's first half does.
    """
    size = len(key)
    position = key.index(dist.get_rank())
    nxt, prev = key[(position + 1) % size], key[(position - 1) % size]
    scratch = torch.empty(n, dtype=flat.dtype, device=flat.device)
    for step in range(size - 1):
        out = (position - step - 1) % size
        into = (position - step - 2) % size
        sent = dist.isend(flat[out * n : (out + 1) * n], nxt, group=group, tag=_RING_TAG)
        received = dist.irecv(scratch, prev, group=group, tag=_RING_TAG)
        assert sent is not None and received is not None  # None only for non-members
        received.wait()
        sent.wait()
        flat[into * n : (into + 1) * n].add_(scratch)


def _pair_exchange(
    flat: torch.Tensor,
    n: int,
    key: Sequence[int],
    group: ProcessGroup | None,
    scratch: torch.Tensor | None,
) -> tuple[_WorkList, torch.Tensor]:
    """The ring of two ranks, asynchronous: send the peer's slice, receive ours into scratch.

    Returns the send and receive (one work) and the scratch (``n`` elements: the given one,
    else a new one) to add to this rank's slice.
    """
    position = key.index(dist.get_rank())
    peer = key[1 - position]
    if scratch is None:
        scratch = torch.empty(n, dtype=flat.dtype, device=flat.device)
    theirs = flat[(1 - position) * n : (2 - position) * n]
    return _WorkList([
        dist.isend(theirs, peer, group=group, tag=_RING_TAG),
        dist.irecv(scratch, peer, group=group, tag=_RING_TAG),
    ]), scratch


def _rooted(ops: list[Callable[[], Any]], async_op: bool) -> _WorkList | None:
    works = _WorkList([op() for op in ops])
    if async_op:
        return works
    works.wait()
    return None


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,  # noqa: A002 - torch's own name
    op: ReduceOp.RedOpType = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    algorithm: str = "auto",
) -> CommWork | None:
    """Reduce the flat ``input`` across ``group`` and keep this rank's equal slice in ``output``.

    The contents of ``input`` are unspecified afterwards (the emulated algorithms reduce in
    place and copy this rank's slice out). ``algorithm``: ``"auto"`` (on gloo shared memory
    for synchronous sums of ranks on one host, the ring for sums of two ranks and for
    synchronous sums of more, else rooted; native elsewhere), ``"shm"``,
    ``"native"``, ``"all_reduce"``, ``"rooted"`` (one reduce per rank) or ``"ring"``
    (``size - 1`` point-to-point steps, sums only; asynchronous for two ranks, for more it
    completes before returning, also with ``async_op``).

    Raises:
        ValueError: ``input`` does not hold exactly ``group size`` slices of ``output``'s size,
            or an unknown ``algorithm``.
    """
    key = group_ranks(group)
    size, n = len(key), output.numel()
    if input.numel() != n * size:
        raise ValueError(
            f"reduce_scatter: input has {input.numel()} elements but the group of {size} ranks "
            f"needs {size} x output ({n}) = {size * n}; pad the input"
        )
    # On gloo a ring of more than two ranks runs step by step before returning: only for
    # synchronous sums (an asynchronous one must not block other groups' collectives).
    ring_ok = op == ReduceOp.SUM and (size == 2 or not async_op)
    summing = input if op == ReduceOp.SUM else None  # shared memory only sums
    chosen = _choose(
        algorithm, group, "ring" if ring_ok else "rooted", summing, async_op, "reduce_scatter"
    )
    if chosen in ("ring", "shm") and op != ReduceOp.SUM:
        raise ValueError(
            f"reduce_scatter: algorithm={chosen!r} only sums, got op={op}; use 'rooted'"
        )
    record = ("reduce_scatter", group, _nbytes(input), _dtype(input))
    if chosen == "native":
        return _run(
            *record,
            lambda: _reduce_scatter_flat(output, input, op=op, group=group, async_op=async_op),
            async_op,
        )
    start = key.index(dist.get_rank()) * n
    flat_in, flat_out = input.view(-1), output.view(-1)
    received: list[torch.Tensor] = []  # the two-rank ring's scratch, added when it arrived

    def copy_slice() -> None:
        if received:
            scratch = received.pop()
            if scratch is flat_out:
                flat_out.add_(flat_in[start : start + n])
            else:
                torch.add(flat_in[start : start + n], scratch, out=flat_out)
        else:
            flat_out.copy_(flat_in[start : start + n])

    if chosen == "shm":
        return _run(
            *record,
            lambda: _done_after(_required_channel(group, key).reduce_scatter, flat_out, flat_in),
            async_op,
        )

    def issue() -> Any:
        if chosen == "ring" and size == 2:
            # the peer's half arrives in the output itself unless it overlaps the input
            free = None if _overlaps(flat_out, flat_in) else flat_out
            works, scratch = _pair_exchange(flat_in, n, key, group, free)
            received.append(scratch)
            if not async_op:
                works.wait()
            return works
        if chosen == "ring":
            _ring_reduce_scatter(flat_in, n, key, group)
            return _Done()
        if chosen == "all_reduce":
            return dist.all_reduce(flat_in, op=op, group=group, async_op=async_op)
        return _rooted(
            [
                functools.partial(
                    dist.reduce,
                    flat_in[i * n : (i + 1) * n],
                    dst=g,
                    op=op,
                    group=group,
                    async_op=True,
                )
                for i, g in enumerate(key)
            ],
            async_op,
        )

    return _run(*record, issue, async_op, copy_slice)


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,  # noqa: A002 - torch's own name
    group: ProcessGroup | None = None,
    async_op: bool = False,
    algorithm: str = "auto",
) -> CommWork | None:
    """Gather every rank's equal-size ``input`` into the flat ``output`` (rank order).

    ``input`` may be a view into ``output`` (at this rank's slot or anywhere else).
    ``algorithm``: ``"auto"`` (on gloo shared memory for synchronous calls of ranks on one
    host, else rooted; native elsewhere), ``"shm"``, ``"native"``,
    ``"all_reduce"`` (zero-filled output summed; exact, though ``-0.0`` arrives as ``0.0``) or
    ``"rooted"`` (one broadcast per rank).

    Raises:
        ValueError: ``output`` does not hold exactly ``group size`` copies of ``input``'s size,
            or an unknown ``algorithm``.
    """
    key = group_ranks(group)
    size, n = len(key), input.numel()
    if output.numel() != n * size:
        raise ValueError(
            f"all_gather: output has {output.numel()} elements but the group of {size} ranks "
            f"gathers {size} x input ({n}) = {size * n}; gloo cannot "
            "gather uneven sizes, pad the inputs to equal size"
        )
    chosen = _choose(algorithm, group, tensor=output, async_op=async_op, kind="all_gather")
    if chosen == "ring":
        raise ValueError("all_gather: algorithm='ring' only reduce-scatters; use 'rooted'")
    record = ("all_gather", group, _nbytes(output), _dtype(output))
    if chosen == "native":
        return _run(
            *record,
            lambda: _all_gather_flat(output, input, group=group, async_op=async_op),
            async_op,
        )
    if chosen == "shm":
        flat_in, flat_out = input.reshape(-1), output.view(-1)
        return _run(
            *record,
            lambda: _done_after(_required_channel(group, key).all_gather, flat_out, flat_in),
            async_op,
        )
    start = key.index(dist.get_rank()) * n
    flat_out = output.view(-1)
    target = flat_out[start : start + n]
    in_place = input.is_contiguous() and input.data_ptr() == target.data_ptr()
    if not in_place:
        mine = input.reshape(-1).clone() if _overlaps(input, output) else input.reshape(-1)
        target.copy_(mine)
    if chosen == "all_reduce":
        flat_out[:start].zero_()
        flat_out[start + n :].zero_()

    def issue() -> Any:
        if chosen == "all_reduce":
            return dist.all_reduce(flat_out, group=group, async_op=async_op)
        return _rooted(
            [
                functools.partial(
                    dist.broadcast,
                    flat_out[i * n : (i + 1) * n],
                    src=g,
                    group=group,
                    async_op=True,
                )
                for i, g in enumerate(key)
            ],
            async_op,
        )

    return _run(*record, issue, async_op)


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1, b1 = a0 + _nbytes(a), b0 + _nbytes(b)
    return a0 < b1 and b0 < a1
