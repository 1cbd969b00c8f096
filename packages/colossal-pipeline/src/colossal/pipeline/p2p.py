"""Point-to-point transfer of pytrees of tensors between pipeline stages.

Each (peer, tag) pair is a *channel*. A message packs all tensors of a pytree into one flat
byte buffer behind a 32-byte header, so a transfer is a single send once both sides know the
metadata (tree structure, small non-tensor values, shapes and dtypes). The sender always knows
what the receiver has cached (the last metadata it sent on that channel), so:

* metadata unchanged (cached): one message ``header(flag=0) + payload`` of the size the
  receiver expects;
* metadata new or changed: a first message of the size the receiver expects carrying
  ``header(flag=1, metadata length, second message length)``, then a second message with the
  pickled metadata and the payload. The receiver updates its cache; nothing else is needed,
  so a shape change re-sends metadata automatically.

Second messages travel on their own tag (``tag + SECOND_TAG``), so they never match a first
message's receive. Outside a step the size the receiver expects is that of the last metadata
on the channel, so a new receive on a channel waits for the older ones first. Inside
:meth:`PipelineP2P.begin_step` / :meth:`PipelineP2P.end_step` the first message's size is
pinned to the metadata both sides knew when the step began; a stage can then post several
receives on one channel ahead of their use (the data flows while it computes). A message whose
payload does not fit the pinned size (the shapes changed in this step) carries
``header(flag=2)`` and its payload in a second message, the metadata still only once.

All sends and first-phase receives of one exchange are posted together through
:mod:`colossal.core.comm` (so they are tracked): one ``isend`` / ``irecv`` per message when the
exchange only sends or only receives, else one ``batch_isend_irecv``. Sends are asynchronous
and waited for in :meth:`PipelineP2P.wait_sends`; posting everything of a batch at once means
no pair of ranks can deadlock on the order of a combined send and receive.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed import ProcessGroup

from colossal.core.comm import CommWork, P2POp, batch_isend_irecv, irecv, isend
from colossal.pipeline.tree import Spec, flatten, unflatten

logger = logging.getLogger(__name__)

HEADER_BYTES = 32
ALIGN = 16
SECOND_TAG = 1 << 30
"""Offset of the tag that carries a transfer's second message (user tags must be below it)."""


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class TreeMeta:
    """What a receiver needs to rebuild a pytree from a payload.

    Attributes:
        spec: The tree structure and non-tensor leaves (see :mod:`colossal.pipeline.tree`).
        tensors: ``(shape, dtype)`` of every tensor leaf, in order.
    """

    spec: Spec
    tensors: tuple[tuple[tuple[int, ...], torch.dtype], ...]

    def offsets(self) -> tuple[list[int], int]:
        """Byte offset of every tensor in the payload, and the payload size."""
        offsets, pos = [], 0
        for shape, dtype in self.tensors:
            offsets.append(pos)
            numel = 1
            for d in shape:
                numel *= d
            pos = _align(pos + numel * dtype.itemsize)
        return offsets, pos


def _pack(tensors: Sequence[torch.Tensor], meta: TreeMeta, out: torch.Tensor) -> None:
    offsets, _ = meta.offsets()
    for t, off in zip(tensors, offsets, strict=True):
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        out[off : off + raw.numel()].copy_(raw)


def _unpack(buf: torch.Tensor, meta: TreeMeta) -> Any:
    offsets, _ = meta.offsets()
    tensors = []
    for (shape, dtype), off in zip(meta.tensors, offsets, strict=True):
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        tensors.append(buf[off : off + nbytes].view(dtype).view(shape))
    return unflatten(tensors, meta.spec)


class PendingRecv:
    """A receive in flight; :meth:`wait` returns the pytree (waiting only the first time)."""

    def __init__(
        self, p2p: PipelineP2P, key: tuple[int, int], buf: torch.Tensor, work: CommWork
    ) -> None:
        self._p2p = p2p
        self._key = key
        self._buf = buf
        self._work: CommWork | None = work
        self._value: Any = None

    @property
    def done(self) -> bool:
        """Whether :meth:`wait` has already produced the value."""
        return self._work is None

    def wait(self) -> Any:
        """Block until the pytree has arrived and return it."""
        if self._work is not None:
            queue = self._p2p._pending[self._key]
            while queue[0] is not self:  # receives of a channel are finished in order
                queue[0].wait()
            self._work.wait()
            self._work = None
            self._value = self._p2p._finish_recv(self._key, self._buf)
            self._buf = None  # type: ignore[assignment]
        return self._value


class PipelineP2P:
    """Sends and receives pytrees to and from other stages, caching metadata per channel.

    Args:
        group: Process group of the pipeline (peers are global ranks in it).
        enable_metadata_cache: Send metadata once per channel and again only when it changes;
            when ``False`` every transfer carries its metadata (two messages).
    """

    def __init__(
        self, group: ProcessGroup | None = None, enable_metadata_cache: bool = True
    ) -> None:
        self.group = group
        self.enable_metadata_cache = bool(enable_metadata_cache)
        self._sent_meta: dict[tuple[int, int], TreeMeta] = {}
        self._recv_meta: dict[tuple[int, int], TreeMeta] = {}
        self._pending: dict[tuple[int, int], list[PendingRecv]] = {}
        self._sends: list[tuple[CommWork, torch.Tensor]] = []
        self._pinned: tuple[dict[tuple[int, int], TreeMeta], dict[tuple[int, int], TreeMeta]] | None
        self._pinned = None
        self.metadata_sent = 0
        """Number of transfers that carried metadata (sender side)."""
        self.metadata_received = 0
        """Number of transfers whose metadata was received."""

    # ---- sending -----------------------------------------------------------------------
    def _messages(self, obj: object, key: tuple[int, int]) -> list[torch.Tensor]:
        tensors, spec = flatten(obj)
        meta = TreeMeta(spec, tuple((tuple(t.shape), t.dtype) for t in tensors))
        _, payload = meta.offsets()
        known = self._sent_meta.get(key) if self.enable_metadata_cache else None
        basis = self._basis(self._sent_meta, 0, key)
        first_size = HEADER_BYTES + (known_payload(basis) if basis is not None else 0)
        if known is not None and known == meta:
            if first_size == HEADER_BYTES + payload:
                msg = torch.empty(first_size, dtype=torch.uint8)
                msg[:HEADER_BYTES].view(torch.int64).zero_()
                _pack(tensors, meta, msg[HEADER_BYTES:])
                return [msg]
            second = torch.empty(payload, dtype=torch.uint8)  # the pinned size does not fit
            _pack(tensors, meta, second)
            return [_header(first_size, 2, 0, payload), second]
        raw = pickle.dumps(meta)
        start = _align(len(raw))
        second = torch.empty(start + payload, dtype=torch.uint8)
        second[: len(raw)].copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        _pack(tensors, meta, second[start:])
        if self.enable_metadata_cache:
            self._sent_meta[key] = meta
        self.metadata_sent += 1
        logger.debug("sending metadata on channel %s: %s", key, meta.tensors)
        return [_header(first_size, 1, len(raw), second.numel()), second]

    def _basis(
        self, cache: dict[tuple[int, int], TreeMeta], side: int, key: tuple[int, int]
    ) -> TreeMeta | None:
        """The metadata whose payload size a channel's first messages have (``None``: empty)."""
        if not self.enable_metadata_cache:
            return None
        if self._pinned is not None:
            return self._pinned[side].get(key)
        return cache.get(key)

    # ---- receiving ---------------------------------------------------------------------
    def _first_buffer(self, key: tuple[int, int]) -> torch.Tensor:
        basis = self._basis(self._recv_meta, 1, key)
        size = HEADER_BYTES + (known_payload(basis) if basis is not None else 0)
        return torch.empty(size, dtype=torch.uint8)

    def _finish_recv(self, key: tuple[int, int], buf: torch.Tensor) -> Any:
        self._pending[key].pop(0)
        flag, meta_len, second_len, _ = buf[:HEADER_BYTES].view(torch.int64).tolist()
        if flag == 0:
            meta = self._recv_meta[key]
            return _unpack(buf[HEADER_BYTES:], meta)
        second = torch.empty(second_len, dtype=torch.uint8)
        src, tag = key
        irecv(second, src, self.group, tag + SECOND_TAG).wait()
        if flag == 2:
            return _unpack(second, self._recv_meta[key])
        meta = pickle.loads(bytes(second[:meta_len].tolist()))  # noqa: S301 - from our own peer
        self.metadata_received += 1
        if self.enable_metadata_cache:
            self._recv_meta[key] = meta
        return _unpack(second[_align(meta_len) :], meta)

    # ---- public ------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Pin every channel's first-message size until :meth:`end_step`.

        Both sides of a channel must call it (before the step's transfers); afterwards a stage
        may post several receives on one channel before it waits for any of them.
        """
        for pending in list(self._pending.values()):
            for p in list(pending):
                p.wait()
        self._pinned = (dict(self._sent_meta), dict(self._recv_meta))

    def end_step(self, wait: bool = True) -> None:
        """Finish every transfer (:meth:`wait_all`) and unpin the first-message sizes.

        Args:
            wait: Finish the transfers first; ``False`` only unpins (after a failed step,
                whose pending transfers may never complete).
        """
        try:
            if wait:
                self.wait_all()
        finally:
            self._pinned = None

    def exchange(
        self, sends: Sequence[tuple[object, int, int]], recvs: Sequence[tuple[int, int]]
    ) -> list[PendingRecv]:
        """Post sends and receives together.

        Args:
            sends: ``(pytree, destination global rank, tag)`` per send.
            recvs: ``(source global rank, tag)`` per receive.

        Returns:
            One :class:`PendingRecv` per receive, in order.
        """
        if self._pinned is None:
            for src, tag in recvs:  # an older receive on the channel must finish first
                for older in list(self._pending.get((src, tag), [])):
                    older.wait()
        ops: list[P2POp] = []
        buffers: list[torch.Tensor] = []
        for obj, dst, tag in sends:
            for n, msg in enumerate(self._messages(obj, (dst, tag))):
                ops.append(P2POp("send", msg, dst, self.group, tag + SECOND_TAG if n else tag))
                buffers.append(msg)
        recv_bufs = []
        for src, tag in recvs:
            buf = self._first_buffer((src, tag))
            ops.append(P2POp("recv", buf, src, self.group, tag))
            recv_bufs.append(buf)
        works = _post(ops)
        n_send = len(buffers)
        self._sends.extend(zip(works[:n_send], buffers, strict=True))
        pending = []
        for (src, tag), buf, work in zip(recvs, recv_bufs, works[n_send:], strict=True):
            p = PendingRecv(self, (src, tag), buf, work)
            self._pending.setdefault((src, tag), []).append(p)
            pending.append(p)
        return pending

    def send(self, obj: object, dst: int, tag: int = 0) -> None:
        """Start sending ``obj`` to global rank ``dst`` (finish with :meth:`wait_sends`)."""
        self.exchange([(obj, dst, tag)], [])

    def recv(self, src: int, tag: int = 0) -> Any:
        """Receive a pytree from global rank ``src`` (blocking)."""
        return self.exchange([], [(src, tag)])[0].wait()

    def wait_sends(self) -> None:
        """Wait until every send posted so far has been delivered."""
        sends, self._sends = self._sends, []
        for work, _ in sends:
            work.wait()

    def wait_all(self) -> None:
        """Finish every pending receive and send."""
        for pending in list(self._pending.values()):
            for p in list(pending):
                p.wait()
        self.wait_sends()


def _header(size: int, flag: int, meta_len: int, second_len: int) -> torch.Tensor:
    """A first message of ``size`` bytes: the header, then zeros."""
    msg = torch.zeros(size, dtype=torch.uint8)
    msg[:HEADER_BYTES].view(torch.int64).copy_(torch.tensor([flag, meta_len, second_len, 0]))
    return msg


def _post(ops: Sequence[P2POp]) -> list[CommWork]:
    """Post ``ops``: one by one when they only send or only receive, else as one batch."""
    kinds = {p.op for p in ops}
    if len(kinds) == 1:
        fn = isend if "send" in kinds else irecv
        return [fn(p.tensor, p.peer, p.group, p.tag) for p in ops]
    return batch_isend_irecv(ops)


def known_payload(meta: TreeMeta) -> int:
    """Payload size in bytes of a message with metadata ``meta``."""
    return meta.offsets()[1]
