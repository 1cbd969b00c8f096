"""Gradient buckets: filled by post-accumulate-grad hooks, reduced in a fixed global order.

Stage 1 keeps a full flat gradient buffer per group and reduces each bucket of it in place (an
all-reduce on gloo; through shared memory a reduce-scatter into this rank's slice, the only
part its step reads, while the other slices keep local gradients); stage 2 copies gradients
into a short-lived bucket buffer, reduce-scatters it and keeps only this rank's slice. A
bucket's collective is started (asynchronously, when overlapping) as soon as all of its
gradients have arrived and every earlier bucket has been started; whatever remains is started
when backward ends, with zeros for parameters that got no gradient, so every rank issues the
same collectives in the same order whatever its graph used.

Stage 2 holds gradient memory only from the first backward of a step to the end of the step:
:meth:`GradReducer.reset` (after ``step``, at ``zero_grad``) frees the gradient slices and the
bucket buffers, so between steps a rank holds its parameters, master slices and optimizer
state slices only (the ZeRO-2 formula).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from colossal.core.comm import CommWork, all_reduce, fp8_reduce_scatter, reduce_scatter, shm
from colossal.zero.layout import Bucket, GroupLayout, ParamSlot

KEEP_BUFFERS = 2
"""Stage-2 bucket buffers kept for the next bucket of the same step (freed by ``reset``)."""


@dataclass
class _BucketState:
    """What happened to one bucket in the current backward and the current step window."""

    arrived: set[int] = field(default_factory=set)  # slots with a grad in this backward
    written: set[int] = field(default_factory=set)  # slots with a grad since the last step
    reduced: int = 0  # reductions since the last step
    cleared: bool = False  # stage 1: other ranks' slices zeroed for a re-reduction
    launched: bool = False  # started in this backward
    buffer: torch.Tensor | None = None  # stage 2 bucket buffer


class GradReducer:
    """Moves gradients from parameters into buckets and reduces them across the DP group.

    Args:
        layouts: Per-group layouts from :func:`~colossal.zero.layout.plan_layout`.
        buckets: Every bucket in the global collective order.
        partition_grad: Stage 2 (reduce-scatter, keep a slice) when True, else stage 1.
        group: Data-parallel process group.
        world_size: Size of ``group``.
        rank: This process's rank within ``group``.
        comm_dtype: dtype gradients are reduced in.
        shard_dtype: dtype of the gradient slices handed to the optimizer (stage 2).
        shard_device: device of those slices.
        overlap: Start collectives during backward (else all at its end, synchronously).
        fp8: Reduce-scatter every bucket as float8 (:func:`colossal.core.comm.fp8_reduce_scatter`,
            synchronous; stage 1 too, into this rank's slice, the only part its step reads).
    """

    def __init__(
        self,
        layouts: Sequence[GroupLayout],
        buckets: Sequence[Bucket],
        partition_grad: bool,
        group: dist.ProcessGroup | None,
        world_size: int,
        rank: int,
        comm_dtype: torch.dtype,
        shard_dtype: torch.dtype,
        shard_device: torch.device,
        device: torch.device,
        overlap: bool,
        fp8: bool = False,
    ) -> None:
        self.layouts = list(layouts)
        self.fp8 = fp8
        self.buckets = list(buckets)
        self.partition_grad = partition_grad
        self.group = group
        self.world_size = world_size
        self.rank = rank
        self.comm_dtype = comm_dtype
        self.shard_dtype = shard_dtype
        self.shard_device = shard_device
        self.overlap = overlap
        # Through shared memory (ranks of one host) both stages reduce-scatter synchronously:
        # faster than gloo's even overlapped (an asynchronous call would take gloo). Stage 1
        # then reduces only this rank's slice of its flat buffer in place (the slice the
        # step reads): half the traffic of an all-reduce, which it needs only on gloo.
        self._shm = shm.available(group, torch.empty(0, dtype=comm_dtype, device=device))
        self._async_ok = not self._shm and not fp8
        self.sync = True
        self._states = [_BucketState() for _ in self.buckets]
        self._next = 0
        self._pending: list[tuple[CommWork | None, Callable[[], None] | None]] = []
        # Stage 1: one persistent gradient buffer per group. Stage 2: slices per bucket.
        self.flat_grads: list[torch.Tensor | None] = [
            None if partition_grad else torch.zeros(lay.numel, dtype=comm_dtype, device=device)
            for lay in self.layouts
        ]
        self.grad_shards: list[torch.Tensor | None] = [None] * len(self.buckets)
        # Stage 2: a reduced bucket's buffer serves the next bucket of the same backward (up
        # to KEEP_BUFFERS are kept); reset() frees them with the gradient slices.
        self._spare_buffers: list[torch.Tensor] = []
        self._device = device
        # Stage 1 with gradients in the parameters' dtype: after a parameter's first gradient
        # of a step, its param.grad is a view into the flat buffer, so later backwards of the
        # step accumulate in place. The first one is copied in (as DDP's bucket views do),
        # which spares zeroing the whole buffer at every step.
        param_dtypes = {s.param.dtype for b in self.buckets for s in b.slots}
        self.grad_views = not partition_grad and param_dtypes == {comm_dtype}

    def _view(self, bucket: Bucket, slot: ParamSlot) -> torch.Tensor:
        flat = self.flat_grads[bucket.group]
        assert flat is not None
        return flat[slot.offset : slot.end].view(slot.param.shape)

    def _attach_views(self) -> None:
        for bucket in self.buckets:
            for slot in bucket.slots:
                slot.param.grad = self._view(bucket, slot)

    # ---- hooks ---------------------------------------------------------------------------
    def on_grad(self, bucket: Bucket, slot: ParamSlot) -> None:
        """Take ``slot.param.grad`` into its bucket and free it (called by the grad hook)."""
        grad = slot.param.grad
        if grad is None:
            return
        state = self._states[bucket.order]
        if self.grad_views and state.reduced and not state.cleared:
            raise RuntimeError(
                "gradients were accumulated onto already-reduced ones; with LowLevelZeroOptimizer "
                "call optimizer.backward(loss) for every micro-batch (or use optimizer.no_sync() "
                "for all but the last), not loss.backward()"
            )
        in_place = (
            self.grad_views
            and slot.numel
            and grad.data_ptr() == self._view(bucket, slot).data_ptr()
        )
        if not in_place:
            target = self._region(bucket, slot, state)
            src = grad.reshape(-1)
            accumulate = slot.index in state.written and not self.partition_grad
            if accumulate or slot.index in state.arrived:
                target.add_(src)
            else:
                target.copy_(src)
            slot.param.grad = self._view(bucket, slot) if self.grad_views else None
        state.written.add(slot.index)
        state.arrived.add(slot.index)
        if self.sync and self.overlap and len(state.arrived) == len(bucket.slots):
            self._launch_ready()

    def _bucket_buffer(self, size: int) -> torch.Tensor:
        """A stage-2 bucket buffer of ``size`` elements: a kept one when one is large enough."""
        for i, spare in enumerate(self._spare_buffers):
            if spare.numel() >= size:
                return self._spare_buffers.pop(i)[:size]
        return torch.empty(size, dtype=self.comm_dtype, device=self._device)

    def _keep_buffer(self, buffer: torch.Tensor) -> None:
        if len(self._spare_buffers) < KEEP_BUFFERS:
            self._spare_buffers.append(buffer if buffer._base is None else buffer._base)

    def _region(self, bucket: Bucket, slot: ParamSlot, state: _BucketState) -> torch.Tensor:
        if self.partition_grad:
            if state.buffer is None:
                state.buffer = self._bucket_buffer(bucket.size)
            lo = slot.offset - bucket.start
            return state.buffer[lo : lo + slot.numel]
        if state.reduced and not state.cleared:
            self._clear_others(bucket, state)
        flat = self.flat_grads[bucket.group]
        assert flat is not None
        return flat[slot.offset : slot.end]

    def _clear_others(self, bucket: Bucket, state: _BucketState) -> None:
        """Stage 1 re-reduction: keep the reduced sum only in this rank's own slice.

        After a reduction this rank's slice holds the sum (after an all-reduce, every slice
        does); summing it again would count it ``W`` times. Zeroing everything but the
        owner's slice makes the next reduction add the new local gradients to exactly one
        copy of the old sum.
        """
        flat = self.flat_grads[bucket.group]
        assert flat is not None
        lo, hi = bucket.shard_range(self.rank, self.world_size)
        flat[bucket.start : lo].zero_()
        flat[hi : bucket.start + bucket.size].zero_()
        state.cleared = True

    # ---- launching -------------------------------------------------------------------------
    def _launch_ready(self) -> None:
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if len(self._states[bucket.order].arrived) < len(bucket.slots):
                return
            self._launch(bucket, async_op=True)

    def _fill_missing(self, bucket: Bucket, state: _BucketState) -> None:
        """Zero the regions of parameters that got no gradient, and the padding."""
        if self.partition_grad:
            if state.buffer is None:
                state.buffer = self._bucket_buffer(bucket.size)
            buf, base, missing = state.buffer, bucket.start, state.arrived
        else:
            if state.reduced and not state.cleared:
                self._clear_others(bucket, state)
            flat = self.flat_grads[bucket.group]
            assert flat is not None
            buf, base, missing = flat, 0, state.written
        for slot in bucket.slots:
            if slot.index not in missing:
                buf[slot.offset - base : slot.end - base].zero_()
        if self.partition_grad:
            buf[bucket.used :].zero_()

    def _launch(self, bucket: Bucket, async_op: bool) -> None:
        async_op = async_op and self._async_ok
        state = self._states[bucket.order]
        self._fill_missing(bucket, state)
        if self.partition_grad:
            buf = state.buffer
            assert buf is not None
            out = torch.empty(
                bucket.shard_size(self.world_size), dtype=self.comm_dtype, device=self._device
            )
            if self.fp8:
                fp8_reduce_scatter(out, buf, group=self.group)
                work = None
            else:
                work = reduce_scatter(out, buf, group=self.group, async_op=async_op)
            post: Callable[[], None] | None = self._accumulate_shard(bucket, state, out)
        else:
            flat = self.flat_grads[bucket.group]
            assert flat is not None
            region = flat[bucket.start : bucket.start + bucket.size]
            if self.fp8:
                lo, hi = bucket.shard_range(self.rank, self.world_size)
                fp8_reduce_scatter(flat[lo:hi], region, group=self.group)
                work = None
            elif self._shm:
                lo, hi = bucket.shard_range(self.rank, self.world_size)
                work = reduce_scatter(flat[lo:hi], region, group=self.group, algorithm="shm")
            else:
                work = all_reduce(region, group=self.group, async_op=async_op)
            post = None
        state.launched = True
        state.reduced += 1
        state.cleared = False
        self._pending.append((work, post))
        self._next = bucket.order + 1

    def _accumulate_shard(
        self, bucket: Bucket, state: _BucketState, out: torch.Tensor
    ) -> Callable[[], None]:
        def post() -> None:
            if state.buffer is not None:
                self._keep_buffer(state.buffer)
            state.buffer = None
            shard = out.to(device=self.shard_device, dtype=self.shard_dtype)
            current = self.grad_shards[bucket.order]
            self.grad_shards[bucket.order] = shard if current is None else current.add_(shard)

        return post

    def flush(self) -> None:
        """End of a backward: start every bucket not yet started (in order) and wait for all."""
        if self.sync:
            for bucket in self.buckets[self._next :]:
                self._launch(bucket, async_op=self.overlap)
            self.wait()
        for state in self._states:
            state.arrived.clear()
            state.launched = False
        self._next = 0

    def wait(self) -> None:
        """Wait for started collectives and file their results."""
        pending, self._pending = self._pending, []
        for work, post in pending:
            if work is not None:
                work.wait()
            if post is not None:
                post()

    def ensure_reduced(self) -> None:
        """Before a step: reduce buckets that were not reduced since the last step.

        Covers a step after ``no_sync`` backwards only, or a rank whose backward never ran;
        every rank reaches the same decision because every rank flushes every bucket. A
        backward run without :meth:`flush` (plain ``loss.backward()``) is flushed first.
        """
        if self._pending or any(s.arrived for s in self._states):
            self.flush()
        if any(s.reduced == 0 for s in self._states):
            previous, self.sync = self.sync, True
            try:
                for bucket in self.buckets:
                    if self._states[bucket.order].reduced == 0:
                        self._launch(bucket, async_op=self.overlap)
                self.wait()
            finally:
                self.sync = previous
                self._next = 0

    # ---- results ---------------------------------------------------------------------------
    def has_grads(self, bucket: Bucket) -> bool:
        """Whether a parameter of ``bucket`` got a gradient since the last step."""
        return bool(self._states[bucket.order].written)

    def shard_grad(self, bucket: Bucket) -> torch.Tensor:
        """This rank's reduced (summed, still scaled) gradient slice of ``bucket``."""
        if self.partition_grad:
            shard = self.grad_shards[bucket.order]
            assert shard is not None, "bucket was never reduced"
            return shard
        flat = self.flat_grads[bucket.group]
        assert flat is not None
        lo, hi = bucket.shard_range(self.rank, self.world_size)
        return flat[lo:hi]

    def prepare_backward(self) -> None:
        """Before a backward: stage 1 buckets already reduced in this step keep one copy only."""
        if self.partition_grad:
            return
        for bucket in self.buckets:
            state = self._states[bucket.order]
            if state.reduced and not state.cleared:
                self._clear_others(bucket, state)

    def reset(self, set_to_none: bool = True) -> None:
        """Forget all gradients (zero_grad / after a step).

        Stage 2 frees its gradient slices and bucket buffers here: nothing of them is held
        between steps.

        Args:
            set_to_none: Leave ``param.grad`` None (the flat buffer is overwritten by the
                next gradients, not zeroed); else zero it and attach views (stage 1).
        """
        self.wait()
        self._states = [_BucketState() for _ in self.buckets]
        self.grad_shards = [None] * len(self.buckets)
        self._spare_buffers.clear()
        self._next = 0
        if self.grad_views and not set_to_none:
            for flat in self.flat_grads:
                assert flat is not None
                flat.zero_()
            self._attach_views()
        else:
            for bucket in self.buckets:
                for slot in bucket.slots:
                    slot.param.grad = None

    def grad_bytes(self) -> int:
        """Bytes of gradient storage this rank holds now (stage 2: none between steps)."""
        total = sum(t.numel() * t.element_size() for t in self.flat_grads if t is not None)
        total += sum(t.numel() * t.element_size() for t in self.grad_shards if t is not None)
        return total

    def buffer_bytes(self) -> int:
        """Bytes of stage-2 bucket buffers kept for the step's next buckets (0 between steps)."""
        return sum(t.numel() * t.element_size() for t in self._spare_buffers)
