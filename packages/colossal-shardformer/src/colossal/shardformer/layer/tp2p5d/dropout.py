""":class:`Dropout2p5D`: dropout whose masks follow the 2.5D partitioning of the activation.

The seeding rule (ColossalAI's 2.5D ``Dropout`` drew from the tensor-parallel RNG state):

* A *partitioned* activation (what every 2.5D layer but the :class:`~.linear.Classifier2p5D`
  returns: block ``(k*q + i, j)``) is split over all ``d*q*q`` ranks: each holds a different
  part, so each draws from its own seed, ``base +`` its tensor-parallel rank; a mask repeated
  on every part would drop the same pattern ``d*q*q`` times over.
* A *replicated* activation (classifier logits: every rank of a row group holds the same
  rows) must be dropped alike by those copies, or they drift apart: the seed is ``base +``
  the row block ``k*q + i``, the same along the row and different across row blocks.

``base`` is one seed drawn from the global RNG of the tensor-parallel group's first rank and
broadcast over the group when the module is built (collective).
"""

from __future__ import annotations

import torch
from torch import nn

from colossal.core import ParallelDims
from colossal.shardformer.layer.tp2p5d._grid import Grid2p5D
from colossal.shardformer.layer.tp2p5d._params import agreed_seed

__all__ = ["Dropout2p5D"]

_STRIDE = 1_000_003  # keeps the per-part seeds apart


class Dropout2p5D(nn.Module):
    """Dropout drawing its masks from a generator seeded per the 2.5D rule above.

    Args:
        p: Probability of an element to be zeroed.
        inplace: Zero in place.
        dims: The job's layout, ``tp_mode="2.5d"``.
        partitioned: True (default): the input is a part only this rank holds. False: it is
            replicated along the row group (classifier logits).

    Raises:
        ValueError: ``p`` outside ``[0, 1]`` or ``dims`` not 2.5D.
    """

    def __init__(
        self,
        p: float = 0.5,
        inplace: bool = False,
        *,
        dims: ParallelDims,
        partitioned: bool = True,
    ) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"{type(self).__name__}: p must lie in [0, 1], got {p}")
        self.p, self.inplace, self.partitioned = float(p), bool(inplace), bool(partitioned)
        self.grid = Grid2p5D(dims)
        part = dims.coordinate("tp") if partitioned else self.grid.row_block
        self.seed = agreed_seed(self.grid) + part * _STRIDE
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed)
            self._generators[device] = gen
        return gen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` with elements zeroed with probability ``p`` (the rest scaled by ``1/(1-p)``)."""
        if not self.training or self.p == 0.0:
            return x
        if self.p == 1.0:
            return x.mul_(0.0) if self.inplace else x * 0.0
        keep = torch.empty_like(x).bernoulli_(1.0 - self.p, generator=self._generator(x.device))
        keep.div_(1.0 - self.p)
        return x.mul_(keep) if self.inplace else x * keep

    def extra_repr(self) -> str:
        """Probability and seeding rule, for ``repr``."""
        return f"p={self.p}, inplace={self.inplace}, partitioned={self.partitioned}"
