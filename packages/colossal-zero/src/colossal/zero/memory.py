"""What the ZeRO optimizer holds in memory on this rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from colossal.zero.optimizer import LowLevelZeroOptimizer


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class MemoryReport:
    """Bytes of model state on this rank.

    Attributes:
        working_params: The model's parameters (flat buffers plus frozen parameters).
        grads: Gradient storage held now: stage 1's full buffers (always); stage 2's slices
            (from the first backward of a step until the step; none between steps).
        master_params: fp32 master copies (0 when the masters are the working slices).
        optimizer_states: Tensors of the wrapped optimizer's state.
        comm_buffers: Stage-2 bucket buffers kept for the step's next reductions (scratch
            of at most two buckets, as DeepSpeed's IPG buckets, freed with the gradient
            slices after the step; not model state, not in :attr:`total`).
    """

    working_params: int
    grads: int
    master_params: int
    optimizer_states: int
    comm_buffers: int = 0

    @property
    def total(self) -> int:
        """Sum of all parts."""
        return self.working_params + self.grads + self.master_params + self.optimizer_states

    @classmethod
    def collect(cls, opt: LowLevelZeroOptimizer) -> MemoryReport:
        """Measure ``opt`` now."""
        flat_ids = {id(s.param) for b in opt.buckets for s in b.slots}
        frozen = sum(_nbytes(p) for p in opt._all_params if id(p) not in flat_ids)
        working = sum(_nbytes(f) for f in opt.flat_params) + frozen
        masters = 0 if opt._master_is_view else sum(_nbytes(m) for m in opt.masters)
        states = sum(
            _nbytes(v)
            for s in opt.optim.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor)
        )
        return cls(working, opt.reducer.grad_bytes(), masters, states,
                   opt.reducer.buffer_bytes())

    def as_dict(self) -> dict[str, int]:
        """The report as a plain dict (with the total)."""
        return {
            "working_params": self.working_params,
            "grads": self.grads,
            "master_params": self.master_params,
            "optimizer_states": self.optimizer_states,
            "comm_buffers": self.comm_buffers,
            "total": self.total,
        }
