"""Dropout seeded for tensor parallelism.

A replicated activation (the residual stream every rank holds in full) must be dropped with
the same mask on every rank of the group, or the ranks' copies drift apart; a split activation
(this rank's heads or columns) must be dropped with a different mask per rank, or the
full-width mask repeats itself every ``1 / tp`` of the width. The global RNG cannot promise
either (ranks may have consumed it differently), so each module owns a ``torch.Generator``
seeded from one seed broadcast over the group when the module is built (plus the rank in the
group for the split kind), and draws its masks from it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup

from colossal.core.comm import broadcast_object
from colossal.shardformer.layer._utils import group_rank, group_size, src_rank

__all__ = ["DropoutForParallelInput", "DropoutForReplicatedInput"]

_RANK_STRIDE = 1_000_003  # keeps the split kind's per-rank seeds apart


class _SeededDropout(nn.Module):
    """Dropout drawing its masks from a generator of its own (seeded by the subclass rule)."""

    _per_rank = False

    def __init__(
        self, p: float = 0.5, inplace: bool = False, process_group: ProcessGroup | None = None
    ) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"{type(self).__name__}: p must lie in [0, 1], got {p}")
        self.p, self.inplace = float(p), bool(inplace)
        self.process_group = process_group
        self.tp_size, self.tp_rank = group_size(process_group), group_rank(process_group)
        seed = int(torch.randint(0, 2**62, ()).item())
        if self.tp_size > 1:
            seed = int(broadcast_object(seed, src=src_rank(process_group), group=process_group))
        self.seed = seed + (self.tp_rank * _RANK_STRIDE if self._per_rank else 0)
        self._generators: dict[torch.device, torch.Generator] = {}

    @classmethod
    def from_native_module(
        cls, module: nn.Dropout, process_group: ProcessGroup | None, **kwargs: object
    ) -> _SeededDropout:
        """A seeded dropout with ``module``'s ``p`` and ``inplace`` (collective over the group).

        Args:
            module: The native ``nn.Dropout``.
            process_group: The tensor-parallel group (the whole job when None).
            **kwargs: Accepted for ColossalAI compatibility and ignored.
        """
        return cls(p=module.p, inplace=module.inplace, process_group=process_group)

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed)
            self._generators[device] = gen
        return gen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` with elements zeroed with probability ``p`` (scaled by ``1 / (1 - p)``)."""
        if not self.training or self.p == 0.0:
            return x
        if self.p == 1.0:
            return x.mul_(0.0) if self.inplace else x * 0.0
        keep = torch.empty_like(x).bernoulli_(1.0 - self.p, generator=self._generator(x.device))
        keep.div_(1.0 - self.p)
        return x.mul_(keep) if self.inplace else x * keep

    def extra_repr(self) -> str:
        """Probability and TP size, for ``repr``."""
        return f"p={self.p}, inplace={self.inplace}, tp_size={self.tp_size}"


class DropoutForParallelInput(_SeededDropout):
    """Dropout for a split activation: a different mask on every rank of the group."""

    _per_rank = True


class DropoutForReplicatedInput(_SeededDropout):
    """Dropout for a replicated activation: the same mask on every rank of the group."""

    _per_rank = False
