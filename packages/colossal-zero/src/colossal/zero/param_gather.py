"""All-gathering the updated parameter slices after a step, optionally behind the next forward.

With ``overlap=True`` the all-gathers are started in forward order (the buckets of the first
layers first) and the step returns at once. Two things then wait, just in time, for the bucket
holding a parameter about to be read:

* a global module forward pre-hook, for the parameters each module owns directly;
* :class:`PendingReadMode`, a ``TorchFunctionMode`` pushed by the step, for every other read
  of a parameter whose bucket has not arrived: a tied weight read by another module, a
  parameter read in a parent's forward, ``state_dict()``, ``p.norm()`` or ``p.copy_(...)``
  between the step and the next forward. A read never sees stale values.

The mode leaves the stack at the first safe point after the last bucket arrived (a module
call or a wait outside the mode, with the mode on top of the stack). When another function
mode is active at the step, the step waits for its all-gathers instead (the two modes' stack
order could not be kept).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from colossal.core import METADATA_GETTERS
from colossal.core.comm import CommWork, all_gather, fp8_all_gather, shm
from colossal.zero.layout import Bucket

# Calls that never read a parameter's values: attribute reads, shape queries and setting or
# dropping its gradient (``zero_grad`` runs between the step and the next forward).
_NO_VALUE_READS = METADATA_GETTERS | frozenset(
    [
        # torch's stubs type these C getset descriptors as plain attributes, hence the ignores.
        torch.Tensor.grad.__set__,  # type: ignore[union-attr]
        torch.Tensor.grad.__delete__,  # type: ignore[union-attr]
        torch.Tensor.shape.__get__,  # type: ignore[attr-defined]
        torch.Tensor.ndim.__get__,  # type: ignore[attr-defined]
        torch.Tensor.requires_grad.__set__,  # type: ignore[attr-defined]
        torch.Tensor.requires_grad_,
        torch.Tensor.size,
        torch.Tensor.dim,
        torch.Tensor.numel,
        torch.Tensor.element_size,
        torch.Tensor.is_floating_point,
        torch.Tensor.is_contiguous,
        torch.Tensor.stride,
        torch.Tensor.storage_offset,
        torch.Tensor.data_ptr,
    ]
)


class PendingReadMode(TorchFunctionMode):
    """Waits for a parameter's bucket before any torch function reads the parameter.

    Args:
        gatherer: The gatherer whose outstanding all-gathers guard the reads.
    """

    def __init__(self, gatherer: ParamGatherer) -> None:
        super().__init__()
        self._gatherer = gatherer

    def __torch_function__(self, func: Callable[..., object], types: Collection[type],
                           args: Sequence[object] = (),
                           kwargs: Mapping[str, object] | None = None) -> object:
        if kwargs is None:
            kwargs = {}
        gatherer = self._gatherer
        if gatherer.pending and func not in _NO_VALUE_READS:
            gatherer.in_mode = True
            try:
                for a in args:
                    if type(a) is list or type(a) is tuple:
                        for b in a:
                            gatherer.wait_for(b)
                    else:
                        gatherer.wait_for(a)
                for a in kwargs.values():
                    gatherer.wait_for(a)
            finally:
                gatherer.in_mode = False
        return func(*args, **kwargs)


class ParamGatherer:
    """Refreshes every rank's full working parameters from the owners' updated slices.

    Args:
        buckets: Every bucket in the global collective order.
        flat_params: The flat working buffer of each param group.
        rank: This rank's index in the data-parallel group.
        world_size: Size of the data-parallel group.
        group: The data-parallel group.
        overlap: Let the next forward overlap the all-gathers.
        fp8: All-gather the slices as float8 (synchronously: no overlap). Each rank keeps its
            own slice exact (the masters may be views of it); the others' slices are within
            the fp8 codec's bound of the owners' values.
    """

    def __init__(
        self,
        buckets: Sequence[Bucket],
        flat_params: Sequence[torch.Tensor],
        rank: int,
        world_size: int,
        group: dist.ProcessGroup | None,
        overlap: bool,
        fp8: bool = False,
    ) -> None:
        self.fp8 = fp8
        self.buckets = list(buckets)
        self.flat_params = list(flat_params)
        self.rank = rank
        self.world_size = world_size
        self.group = group
        # Through shared memory (one host) a synchronous all-gather beats an overlapped one
        # (an asynchronous call would take gloo).
        self.overlap = (
            overlap
            and not fp8
            and not (world_size > 1 and flat_params and shm.available(group, flat_params[0]))
        )
        self._bucket_of = {id(s.param): b.order for b in self.buckets for s in b.slots}
        self._pending: dict[int, CommWork | None] = {}  # insertion order = issue order
        self._hook: RemovableHandle | None = None
        self._mode: PendingReadMode | None = None
        self.in_mode = False  # True while the mode's handler waits (it cannot leave then)

    @property
    def pending(self) -> bool:
        """Whether some bucket's all-gather has not been waited for."""
        return bool(self._pending)

    def gather(self) -> None:
        """Start the all-gather of every bucket (and wait, unless overlapping)."""
        if self.world_size == 1:
            return
        self.wait_all()
        order = reversed(self.buckets) if self.overlap else self.buckets
        with torch.no_grad():
            for bucket in order:
                flat = self.flat_params[bucket.group]
                lo, hi = bucket.shard_range(self.rank, self.world_size)
                region = flat[bucket.start : bucket.start + bucket.size]
                if self.fp8:
                    own = flat[lo:hi].clone()
                    fp8_all_gather(region, own, group=self.group)
                    flat[lo:hi].copy_(own)
                    continue
                self._pending[bucket.order] = all_gather(
                    region, flat[lo:hi], group=self.group, async_op=self.overlap
                )
        if not self.overlap or (self._mode is None and torch._C._len_torch_function_stack()):
            self.wait_all()
            return
        if self._mode is None:
            self._mode = PendingReadMode(self)
            self._mode.__enter__()
        if self._hook is None:
            self._hook = nn.modules.module.register_module_forward_pre_hook(self._before_forward)

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        for param in module._parameters.values():
            if param is not None:
                self.wait_for(param)
        self._leave_when_done()

    def wait_for(self, tensor: object) -> None:
        """Wait for the bucket of ``tensor`` if it is a parameter whose bucket is in flight."""
        order = self._bucket_of.get(id(tensor))
        if order is not None and order in self._pending:
            self.wait_until(order)

    def wait_until(self, order: int) -> None:
        """Wait for the all-gathers issued up to and including bucket ``order``."""
        while self._pending:
            done, work = next(iter(self._pending.items()))
            del self._pending[done]
            if work is not None:
                work.wait()
            if done == order:
                break
        self._leave_when_done()

    def _leave_when_done(self) -> None:
        """Pop the mode and drop the hook once nothing is in flight, where that is safe."""
        if self._pending or self.in_mode:
            return
        if self._mode is not None:
            stack = [
                torch._C._get_function_stack_at(i)
                for i in range(torch._C._len_torch_function_stack())
            ]
            if stack and stack[-1] is self._mode:
                self._mode.__exit__(None, None, None)
            elif any(mode is self._mode for mode in stack):
                return  # another mode is above ours: leave at a later safe point
            self._mode = None
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def wait_all(self) -> None:
        """Wait for every outstanding all-gather."""
        if self._pending:
            self.wait_until(-1)
