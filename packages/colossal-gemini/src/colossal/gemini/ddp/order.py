"""The backward walk: the order of gathers, releases and reductions in one backward.

Every rank must issue the same collectives in the same order, yet which modules run backward
(and when gradients arrive) may differ between ranks: a module whose output reaches the loss
on rank 0 only runs backward there. So nothing collective may depend on local gradient
arrival. The walk makes gathers depend only on the forward's chunk access sequence, which is
the same on every rank (a forward that runs different modules on different ranks is not
supported):

* the forward records ``(call, chunk)`` entries; backward visits them reversed;
* when the backward of call ``k`` starts, the walk advances entry by entry up to the end of
  ``k``'s entries, gathering every entry's chunk that is not gathered, including the chunks
  of calls skipped on this rank (their modules never run backward here);
* the end of backward finishes the walk the same way.

A chunk's last entry is *passed* once the walk has moved beyond its call. Reductions run on
a separate process group, asynchronously, in the fixed order in which chunks' last entries
are passed (trainable chunks never accessed in forward come last, in chunk order). A chunk's
reduction is launched when its last entry is passed, all its gradients are in locally and
every chunk before it has been launched; the end of backward launches the rest (tensors
without a gradient contribute zeros) and waits for all. Since reductions are asynchronous
and on their own group, launching one early never blocks another rank's gathers.

A trainable chunk is released right after its reduction is launched; a frozen chunk (no
gradients tell when its last backward use is done) at the end of backward.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from colossal.core.comm import CommWork
from colossal.gemini.chunk import Chunk

logger = logging.getLogger(__name__)

__all__ = ["BackwardWalk", "ForwardRecord"]


@dataclass
class ForwardRecord:
    """The chunk access sequence of one forward: ``(call id, chunk)`` entries in order.

    Only calls whose outputs take part in autograd are kept (:meth:`drop_call` removes the
    others), so the backward walk never gathers chunks no backward can use.
    """

    entries: list[tuple[int, Chunk]] = field(default_factory=list)
    calls: int = 0

    def new_call(self, chunks: Sequence[Chunk]) -> int:
        """Record one module call using ``chunks``; return its call id."""
        call = self.calls
        self.calls += 1
        self.entries.extend((call, c) for c in chunks)
        return call

    def drop_call(self, call: int) -> None:
        """Forget the entries of ``call`` (its outputs need no gradient)."""
        self.entries = [e for e in self.entries if e[0] != call]

    def chunks(self) -> list[Chunk]:
        """The chunks in order of access (repeats included)."""
        return [c for _, c in self.entries]


class BackwardWalk:
    """Drives the gathers, reductions and releases of one backward (see the module doc).

    Args:
        record: The forward's access sequence.
        trainable: Every trainable chunk of the model, in chunk order.
        gather: Makes a chunk's payload available: a collective on the gather group unless
            it is gathered already (then it only waits for an in-flight prefetch).
        release: Releases a sharded chunk's payload (local).
        launch: Launches a chunk's asynchronous reduction (a collective on the reduce group)
            and returns its handle (``None`` when done already).
        prefetch: Called with the chunks of the entries ahead after each advance.
    """

    def __init__(
        self,
        record: ForwardRecord,
        trainable: Sequence[Chunk],
        *,
        gather: Callable[[Chunk], None],
        release: Callable[[Chunk], None],
        launch: Callable[[Chunk], CommWork | None],
        prefetch: Callable[[Sequence[Chunk]], None] | None = None,
    ) -> None:
        self._entries = list(reversed(record.entries))
        self._span: dict[int, tuple[int, int]] = {}
        for i, (call, _) in enumerate(self._entries):
            lo, _hi = self._span.get(call, (i, i))
            self._span[call] = (lo, i + 1)
        self._last: dict[int, int] = {}
        for i, (_, chunk) in enumerate(self._entries):
            self._last[chunk.chunk_id] = i
        in_walk = sorted((i, c) for c, i in self._last.items())
        by_id = {c.chunk_id: c for c in trainable}
        order = [by_id[cid] for _, cid in in_walk if cid in by_id]
        order += [c for c in trainable if c.chunk_id not in self._last]
        self.reduce_order: list[Chunk] = order
        self._gather, self._release, self._launch = gather, release, launch
        self._prefetch = prefetch
        self._pos = 0  # next entry to gather
        self._passed = 0  # entries before this index are passed
        self._done: set[int] = set()  # chunk ids whose last entry is passed
        self._next_launch = 0
        self.launched: list[Chunk] = []
        # launched, not finished, in order
        self._in_flight: list[tuple[Chunk, CommWork | None]] = []
        self.finished = False

    # ------------------------------------------------------------------ walk
    def reached(self, call: int) -> None:
        """The backward of ``call`` is about to run: advance to it (gathering on the way)."""
        span = self._span.get(call)
        if span is None:
            return
        lo, hi = span
        if lo < self._passed:
            # Autograd ran this call after a call that comes later in the walk (parallel
            # branches); its chunks are still gathered unless a gradient-complete trainable
            # chunk was released, which cannot happen while this call's backward is pending.
            for _, chunk in self._entries[lo:hi]:
                if not chunk.is_gathered:
                    logger.warning("chunk %d needed behind the backward walk; gathering it "
                                   "(a collective other ranks may not issue)", chunk.chunk_id)
                    self._gather(chunk)
            return
        self._advance(lo, hi)

    def _advance(self, passed: int, pos: int) -> None:
        for i in range(self._pos, pos):
            self._gather(self._entries[i][1])  # a no-op (no collective) when gathered
        self._pos = max(self._pos, pos)
        for i in range(self._passed, passed):
            chunk = self._entries[i][1]
            if self._last[chunk.chunk_id] == i:
                self._done.add(chunk.chunk_id)
        self._passed = max(self._passed, passed)
        if self._prefetch is not None and self._pos < len(self._entries):
            self._prefetch([c for _, c in self._entries[self._pos :]])
        self.try_launch()

    # ------------------------------------------------------------------ reductions
    def try_launch(self) -> None:
        """Launch, in order, every reduction whose chunk is passed and gradient-complete."""
        while self._next_launch < len(self.reduce_order):
            chunk = self.reduce_order[self._next_launch]
            if chunk.chunk_id not in self._done or not chunk.all_grads_ready():
                return
            self._launch_next()
        self.poll()

    def _launch_next(self) -> None:
        chunk = self.reduce_order[self._next_launch]
        self._next_launch += 1
        self._in_flight.append((chunk, self._launch(chunk)))
        self.launched.append(chunk)
        if not chunk.keep_gathered:
            self._release(chunk)

    def poll(self) -> None:
        """Finish (free the gradient buffers of) the launched reductions that completed.

        Never waits: a rank blocked on a reduction another rank launches only after more
        gathers would deadlock.
        """
        while self._in_flight:
            chunk, work = self._in_flight[0]
            if work is not None and not work.is_completed():
                return
            self._in_flight.pop(0)
            chunk.finish_reduce()

    def make_room(self, fits: Callable[[], bool]) -> None:
        """Under device memory pressure, wait for launched reductions (oldest first).

        Waiting is safe when every rank gets its gradients before the walk passes their
        chunks; when a chunk's gradients reach some rank only at the end of backward (an
        output unused there) and memory is short at that moment, the wait ends in the
        collective timeout's error instead of a hang.
        """
        while self._in_flight and not fits():
            chunk, _ = self._in_flight.pop(0)
            chunk.finish_reduce()

    def finish(self) -> None:
        """End of backward: finish the walk, launch every remaining reduction, wait for all."""
        if self.finished:
            return
        self.finished = True
        n = len(self._entries)
        self._prefetch = None
        self._advance(n, n)
        self._done.update(c.chunk_id for c in self.reduce_order)
        while self._next_launch < len(self.reduce_order):
            self._launch_next()
        for chunk, _ in self._in_flight:
            chunk.finish_reduce()
        self._in_flight.clear()
        for _, chunk in self._entries:
            if chunk.is_gathered and not chunk.keep_gathered:
                self._release(chunk)
