"""Module and parameter hooks that gather, release and reduce chunks around forward/backward.

* forward pre-hook (modules that directly own managed parameters): gather their chunks,
  tensors ``HOLD -> COMPUTE``, record the access;
* forward post-hook: ``COMPUTE -> HOLD``; a sharded chunk is released once every tensor of it
  has been used in this forward and none is computing (one gather per chunk per forward,
  except a tied weight used again later); a multi-grad hook on the call's outputs tells the
  backward walk (``order.py``) when the call's backward starts;
* post-accumulate-grad hook (trainable parameters): copy ``p.grad`` into the chunk's gradient
  buffer, drop ``p.grad``, let the walk launch what became ready; the first one queues the
  end-of-backward callback;
* :meth:`ChunkRuntime.outside_use` (the root forward): a managed parameter used outside its
  module's call is one call of its own (``outside.py``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.distributed import ProcessGroup
from torch.utils.hooks import RemovableHandle

from colossal.core.comm import CommWork
from colossal.gemini.chunk import Chunk, ChunkManager, TensorState
from colossal.gemini.ddp.order import BackwardWalk, ForwardRecord
from colossal.gemini.ddp.outside import DERIVED, METADATA_GETTERS, OutsideUseMode

logger = logging.getLogger(__name__)

__all__ = ["ChunkRuntime"]


def _unique(chunks: Sequence[Chunk]) -> list[Chunk]:
    seen: set[int] = set()
    out = []
    for c in chunks:
        if c.chunk_id not in seen:
            seen.add(c.chunk_id)
            out.append(c)
    return out


class _OwnWork:
    """``with runtime.own_work:`` marks the runtime's own operators (never outside uses).

    Re-entrant: the previous ``busy`` value is restored on exit. A plain class rather than a
    generator context manager: it runs in every module hook.
    """

    def __init__(self, runtime: ChunkRuntime) -> None:
        self._runtime = runtime
        self._saved: list[bool] = []

    def __enter__(self) -> None:
        self._saved.append(self._runtime.busy)
        self._runtime.busy = True

    def __exit__(self, *exc: object) -> None:
        self._runtime.busy = self._saved.pop()


class ChunkRuntime:
    """The per-step state of the hooks: the forward record and the backward walk.

    Args:
        manager: The model's chunk manager.
        reduce_group: Process group for the reductions (same ranks as the chunks' group).
        accumulate: Add each backward's reduced gradient to the existing gradient shard.
        before_gather: Called with the chunks about to be gathered and the step index (the
            auto placement's eviction point), and with ``(chunks, step, nbytes)`` when a
            gradient buffer of ``nbytes`` for ``chunks`` does not fit even after waiting for
            the launched reductions; may be ``None``.
        fits: Whether ``nbytes`` more fit on the device (the budget's ``fits``); when not,
            launched reductions are waited for to free their gradient buffers.
    """

    def __init__(
        self,
        manager: ChunkManager,
        reduce_group: ProcessGroup | None,
        *,
        accumulate: bool = False,
        before_gather: Callable[..., None] | None = None,
        fits: Callable[[int], bool] | None = None,
    ) -> None:
        self.manager = manager
        self.reduce_group = reduce_group
        self.accumulate = accumulate
        self.before_gather = before_gather
        self.fits = fits
        self.record = ForwardRecord()
        self.previous: list[Chunk] = []  # last forward's access sequence (forward prefetch)
        self.walk: BackwardWalk | None = None
        self.step = 0  # module steps (pre-forward and pre-backward events) this iteration
        self._used: set[int] = set()  # ids of parameters used in this forward
        self._callback_queued = False
        self._calls: dict[int, list[int]] = {}  # open call ids per module (re-entrant calls)
        self._handles: list[RemovableHandle] = []
        # Outside uses (outside.py): id -> TensorInfo (managed params) or DERIVED (views of a
        # payload made by an outside use, kept alive until the root forward ends).
        self.watch: dict[int, Any] = {}
        self.busy = False  # the runtime's own work runs: its operators are not uses
        self.own_work = _OwnWork(self)  # ``with self.own_work:`` sets ``busy`` meanwhile
        self._params: dict[int, tuple[nn.Parameter, Chunk]] = {}
        self._derived: dict[int, tuple[torch.Tensor, Chunk]] = {}
        self._pinned: dict[int, Chunk] = {}  # chunks a derived tensor aliases

    # ------------------------------------------------------------------ installing
    def install(self, module: nn.Module) -> None:
        """Hook every submodule that directly owns managed parameters and every trainable one."""
        for sub in module.modules():
            params = [p for p in sub.parameters(recurse=False)]
            if not params:
                continue
            self._handles.append(sub.register_forward_pre_hook(self._pre_forward(params)))
            self._handles.append(sub.register_forward_hook(self._post_forward(params)))
        seen: set[int] = set()
        for p in module.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
        for chunk in self.manager.chunks:
            for p, info in chunk.infos.items():
                self._params[id(p)] = (p, chunk)
                self.watch[id(p)] = info

    def remove(self) -> None:
        """Remove every hook (outside uses are no longer watched either)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.watch.clear()
        self._params.clear()

    # ------------------------------------------------------------------ forward
    def start_forward(self) -> None:
        """A new root forward: forget the last record (a forward without backward included)."""
        if self.walk is not None and not self.walk.finished:
            logger.debug("a new forward began before the last backward finished; resetting")
        if self.record.entries:
            self.previous = self.record.chunks()
        self.record = ForwardRecord()
        self.walk = None
        self.step = 0
        self._used.clear()
        self._forget_derived()

    @contextlib.contextmanager
    def outside_use(self) -> Iterator[None]:
        """The root forward's scope: operators on managed parameters outside their module.

        Inside it, an operator whose argument is a managed parameter not in ``COMPUTE`` (or a
        view of a payload an earlier such operator made) is one call (:meth:`outside_call`).
        On exit the chunks those views alias are released.
        """
        if not self._params:
            yield
            return
        try:
            with OutsideUseMode(self):
                yield
        finally:
            self._forget_derived()
            try:
                with self.own_work:
                    self._maybe_release(list(self._pinned.values()), require_used=False)
            finally:
                self._pinned.clear()

    def _forget_derived(self) -> None:
        for key in self._derived:
            self.watch.pop(key, None)
        self._derived.clear()

    def outside_call(self, func: Callable[..., object], args: Sequence[object],
                     kwargs: Mapping[str, object]) -> object:
        """Run one operator that uses managed parameters outside their module, as a call.

        Gather the chunks of the parameters (and of the derived views) it reads, record the
        call, ``COMPUTE``, run, ``HOLD``; a multi-grad hook on its outputs lets the backward
        walk gather them again before the operator's backward. Outputs aliasing a payload
        become derived views and pin their chunk until the root forward ends.
        """
        if func in METADATA_GETTERS:
            return func(*args, **kwargs)
        params: list[nn.Parameter] = []
        chunks: list[Chunk] = []
        for leaf in pytree.tree_leaves((list(args), kwargs)):
            hit = self._params.get(id(leaf))
            if hit is not None:
                if self.watch[id(leaf)].state is not TensorState.COMPUTE:
                    params.append(hit[0])
                    chunks.append(hit[1])
                continue
            derived = self._derived.get(id(leaf))
            if derived is not None:
                chunks.append(derived[1])
        chunks = _unique(chunks)
        with self.own_work:
            self._gather(chunks)
            call = self.record.new_call(chunks)
            for p in params:
                self.manager.chunk_of(p).set_state(p, TensorState.COMPUTE)
        try:
            out = func(*args, **kwargs)
        finally:
            with self.own_work:
                for p in params:
                    self.manager.chunk_of(p).set_state(p, TensorState.HOLD)
                    self._used.add(id(p))
        with self.own_work:
            self._after_outside_call(call, chunks, out)
        return out

    def _after_outside_call(self, call: int, chunks: list[Chunk], out: object) -> None:
        tensors = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        storages = {c.payload.untyped_storage().data_ptr(): c for c in chunks
                    if c.payload is not None and not c.keep_gathered}
        for t in tensors:
            if id(t) in self._params or id(t) in self._derived:
                continue
            chunk = storages.get(t.untyped_storage().data_ptr()) if storages else None
            if chunk is not None:
                self._derived[id(t)] = (t, chunk)
                self.watch[id(t)] = DERIVED
                self._pinned[chunk.chunk_id] = chunk
        self._maybe_release(chunks)
        outs = [t for t in tensors if t.requires_grad and t.grad_fn is not None]
        if outs and torch.is_grad_enabled():
            register_multi_grad_hook(outs, self._pre_backward(call, count_step=False),
                                     mode="any")
        else:
            self.record.drop_call(call)

    def _maybe_release(self, chunks: list[Chunk], *, require_used: bool = True) -> None:
        """Release each sharded chunk that is idle (every tensor ``HOLD``) and done with.

        Done with: every tensor used in this forward (``require_used``) and no derived view
        aliases the payload (pinned until the root forward ends).
        """
        for chunk in chunks:
            if chunk.keep_gathered or not chunk.is_gathered:
                continue
            if require_used and (chunk.chunk_id in self._pinned
                                 or not all(id(p) in self._used for p in chunk.params)):
                continue
            if all(i.state is TensorState.HOLD for i in chunk.infos.values()):
                self.manager.release(chunk)

    def _gather(self, chunks: list[Chunk]) -> None:
        if self.walk is not None:
            self.walk.poll()
            need = sum(c.payload_bytes for c in chunks if not c.is_gathered)
            self._make_room(need, chunks, evict=False)  # the eviction follows below
        todo = [c for c in chunks if not c.is_gathered]
        if todo and self.before_gather is not None:
            self.before_gather(todo, self.step)
        for c in chunks:
            self.manager.access(c)

    def _pre_forward(self, params: list[nn.Parameter]) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            with self.own_work:
                chunks = _unique([self.manager.chunk_of(p) for p in params])
                self._gather(chunks)
                self.step += 1
                position = len(self.record.entries)
                self._calls.setdefault(id(module), []).append(self.record.new_call(chunks))
                for p in params:
                    self.manager.chunk_of(p).set_state(p, TensorState.COMPUTE)
                ahead = self.previous[position + len(chunks) :]
                if ahead and self.manager.max_prefetch:
                    self.manager.prefetch(ahead)

        return hook

    def _post_forward(self, params: list[nn.Parameter]) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            with self.own_work:
                call = self._calls[id(module)].pop()
                chunks = _unique([self.manager.chunk_of(p) for p in params])
                for p in params:
                    self.manager.chunk_of(p).set_state(p, TensorState.HOLD)
                    self._used.add(id(p))
                self._maybe_release(chunks)
                outs = [t for t in pytree.tree_leaves(output)
                        if isinstance(t, torch.Tensor) and t.requires_grad]
                if outs and torch.is_grad_enabled():
                    register_multi_grad_hook(outs, self._pre_backward(call), mode="any")
                else:
                    self.record.drop_call(call)
            return None

        return hook

    # ------------------------------------------------------------------ backward
    def _ensure_walk(self) -> BackwardWalk:
        if self.walk is None:
            if any(c.reducing for c in self.manager.chunks):
                raise RuntimeError("a reduction of the last backward is still in flight")
            self.walk = self._new_walk(prefetch=True)
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)
        return self.walk

    def _new_walk(self, prefetch: bool) -> BackwardWalk:
        """The backward walk over the recorded forward (prefetching when asked and enabled)."""
        return BackwardWalk(
            self.record,
            [c for c in self.manager.chunks if c.requires_grad],
            gather=lambda c: self._gather([c]),
            release=self.manager.release,
            launch=self._launch,
            prefetch=self.manager.prefetch if prefetch and self.manager.max_prefetch else None,
        )

    def _make_room(self, nbytes: int, needed: list[Chunk], *, evict: bool = True) -> None:
        """Wait for launched reductions (their buffers free), then evict, until it fits."""
        if self.walk is not None and self.fits is not None and nbytes:
            self.walk.make_room(lambda: self.fits(nbytes))  # type: ignore[misc]
            if evict and self.before_gather is not None and not self.fits(nbytes):
                self.before_gather(needed, self.step, nbytes)

    def _launch(self, chunk: Chunk) -> CommWork | None:
        if not chunk.keep_gathered and chunk.world_size > 1:
            self._make_room(chunk.shard_bytes, [chunk])  # the reduce-scatter's output
        accumulate = self.accumulate and chunk.grad_shard is not None
        return chunk.reduce(accumulate=accumulate, group=self.reduce_group, async_op=True)

    def _pre_backward(self, call: int, *, count_step: bool = True) -> Callable[..., None]:
        """Before ``call``'s backward: advance the walk (outside uses are no module step)."""
        def hook(grads: Any) -> None:
            walk = self._ensure_walk()
            if count_step:
                self.step += 1
            walk.reached(call)

        return hook

    def _on_grad(self, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        walk = self._ensure_walk()
        chunk = self.manager.chunk_of(param)  # type: ignore[arg-type]
        if not chunk.reducing and chunk.memory()["device"] < chunk.payload_bytes * 2:
            self._make_room(chunk.payload_bytes, [chunk])  # the gradient buffer comes next
        chunk.copy_grad(param, grad)  # type: ignore[arg-type]
        param.grad = None
        walk.try_launch()

    def finish_backward(self) -> None:
        """End of backward: finish the walk (every rank the same collectives); idempotent."""
        self._callback_queued = False
        if self.walk is not None and self.walk.finished:
            return
        if self.walk is None:
            if not self.record.entries and not any(c.requires_grad for c in self.manager.chunks):
                return
            self.walk = self._new_walk(prefetch=False)
        self.walk.finish()
        # Replicas (extra data parallelism) average the shards only after the walk: no rank
        # then waits on a replica while its shard group still needs it. Accumulated
        # gradients are averaged once, when the optimizer reads them.
        self.manager.mark_replica_grads_pending()
        if not self.accumulate:
            self.manager.reduce_replica_grads()
        self.previous = self.record.chunks()
        self.record = ForwardRecord()
