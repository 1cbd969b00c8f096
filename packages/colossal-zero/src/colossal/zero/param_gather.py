"""All-gathering the updated parameter slices after a step, optionally behind the next forward.

With ``overlap=True`` the all-gathers are started in forward order (the buckets of the first
layers first) and the step returns at once; a global module forward pre-hook waits, just in
time, for the buckets holding the parameters of each module about to run. Parameters must
then be read through their module's forward (or after :meth:`ParamGatherer.wait_all`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from colossal.core.comm import CommWork, all_gather
from colossal.zero.layout import Bucket


class ParamGatherer:
    """Refreshes every rank's full working parameters from the owners' updated slices.

    Args:
        buckets: Every bucket in the global collective order.
        flat_params: The flat working buffer of each param group.
        rank: This rank's index in the data-parallel group.
        world_size: Size of the data-parallel group.
        group: The data-parallel group.
        overlap: Let the next forward overlap the all-gathers.
    """

    def __init__(
        self,
        buckets: Sequence[Bucket],
        flat_params: Sequence[torch.Tensor],
        rank: int,
        world_size: int,
        group: dist.ProcessGroup | None,
        overlap: bool,
    ) -> None:
        self.buckets = list(buckets)
        self.flat_params = list(flat_params)
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.overlap = overlap
        self._bucket_of = {id(s.param): b.order for b in self.buckets for s in b.slots}
        self._pending: dict[int, CommWork | None] = {}  # insertion order = issue order
        self._hook: RemovableHandle | None = None

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
                self._pending[bucket.order] = all_gather(
                    region, flat[lo:hi], group=self.group, async_op=True
                )
        if not self.overlap:
            self.wait_all()
        elif self._hook is None:
            self._hook = nn.modules.module.register_module_forward_pre_hook(self._before_forward)

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        for param in module._parameters.values():
            if param is not None:
                order = self._bucket_of.get(id(param))
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
        if not self._pending and self._hook is not None:
            self._hook.remove()
            self._hook = None

    def wait_all(self) -> None:
        """Wait for every outstanding all-gather."""
        if self._pending:
            self.wait_until(-1)
