"""Counting the calls and bytes that pass through Colossal's communication helpers.

Every helper in :mod:`colossal.core.comm` reports to the trackers that are active at the time
of the call. Trackers are registered process-wide (not per thread or per context), because
gradient hooks may issue collectives from the autograd engine's own threads.

Byte counts are the *logical* size of each collective, the same on every rank:

========================  =====================================================
kind                      bytes counted
========================  =====================================================
``all_reduce``            the tensor reduced
``reduce_scatter``        the full (unscattered) input
``all_gather``            the full (gathered) output
``broadcast``             the tensor broadcast
``reduce``                the tensor reduced
``all_to_all``            the input exchanged
``send`` / ``recv``       the tensor sent or received by this rank
``*_object``              the pickled payload of this rank
========================  =====================================================

The ``fp8_*`` helpers (:mod:`colossal.core.comm.fp8`) record their kind with the float8
dtype and the encoded bytes (one per element plus four per scale), one record per call.
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType

GroupKey = tuple[int, ...]


@dataclass(frozen=True)
class CommRecord:
    """One call of a communication helper.

    Attributes:
        kind: Collective kind, e.g. ``"all_reduce"`` or ``"send"``.
        group: Global ranks of the process group the call ran on.
        nbytes: Logical bytes of the call (see the module docstring).
        dtype: Name of the element type, e.g. ``"float32"``.
    """

    kind: str
    group: GroupKey
    nbytes: int
    dtype: str


@dataclass
class CommStats:
    """Calls and bytes of one (kind, group) pair."""

    calls: int = 0
    nbytes: int = 0


_LOCK = threading.Lock()
_ACTIVE: list[CommTracker] = []


class _Quiet(threading.local):
    depth = 0  # of quiet() blocks in this thread


_QUIET = _Quiet()


class CommTracker:
    """Context manager recording per kind and per group the calls and bytes of communication.

    Example:
        >>> with CommTracker() as tracker:
        ...     all_reduce(t, group=dp_group)
        >>> tracker.calls("all_reduce"), tracker.bytes("all_reduce")

    Trackers nest: each active tracker sees every call made while it is active.
    """

    def __init__(self) -> None:
        self.records: list[CommRecord] = []
        self._lock = threading.Lock()

    def __enter__(self) -> CommTracker:
        with _LOCK:
            _ACTIVE.append(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with _LOCK:
            if self in _ACTIVE:
                _ACTIVE.remove(self)

    def add(self, record: CommRecord) -> None:
        """Append one record (called by the communication helpers)."""
        with self._lock:
            self.records.append(record)

    def reset(self) -> None:
        """Forget everything recorded so far."""
        with self._lock:
            self.records.clear()

    def _select(self, kind: str | None, group: GroupKey | None) -> list[CommRecord]:
        with self._lock:
            records = list(self.records)
        return [
            r
            for r in records
            if (kind is None or r.kind == kind) and (group is None or r.group == tuple(group))
        ]

    def calls(self, kind: str | None = None, group: GroupKey | None = None) -> int:
        """Number of calls, optionally of one ``kind`` and/or on one ``group`` (global ranks)."""
        return len(self._select(kind, group))

    def bytes(self, kind: str | None = None, group: GroupKey | None = None) -> int:
        """Logical bytes moved, optionally of one ``kind`` and/or on one ``group``."""
        return sum(r.nbytes for r in self._select(kind, group))

    def summary(self) -> dict[str, dict[GroupKey, CommStats]]:
        """Calls and bytes per kind and per group."""
        out: dict[str, dict[GroupKey, CommStats]] = defaultdict(dict)
        for r in self._select(None, None):
            stats = out[r.kind].setdefault(r.group, CommStats())
            stats.calls += 1
            stats.nbytes += r.nbytes
        return dict(out)

    def table(self) -> str:
        """The summary as a markdown table."""
        lines = ["| kind | group | calls | bytes |", "|---|---|---:|---:|"]
        for kind, groups in sorted(self.summary().items()):
            for group, stats in sorted(groups.items()):
                lines.append(f"| {kind} | {list(group)} | {stats.calls} | {stats.nbytes} |")
        return "\n".join(lines)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Record nothing from this thread inside the block.

    A composite collective (e.g. :mod:`colossal.core.comm.fp8`'s all-reduce, an all-to-all
    then an all-gather of float8 bytes) records itself once, as one logical call, and runs its
    parts quietly.
    """
    _QUIET.depth += 1
    try:
        yield
    finally:
        _QUIET.depth -= 1


def record(kind: str, group: GroupKey, nbytes: int, dtype: str) -> None:
    """Report one call to every active tracker (cheap when none is active)."""
    if not _ACTIVE or _QUIET.depth:
        return
    rec = CommRecord(kind, group, int(nbytes), dtype)
    with _LOCK:
        trackers = list(_ACTIVE)
    for tracker in trackers:
        tracker.add(rec)
