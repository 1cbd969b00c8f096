"""The MoE environment of a config-era job (ColossalAI's ``moe_env`` / ``MOE_CONTEXT``).

One object answers the seeds' questions about the MoE setup (``moe_env.is_initialized``,
``model_parallel_size``, ``data_parallel_size``) from ``gpc``'s ``MOE_MODEL`` / ``MOE_DATA``
groups, and collects the auxiliary (load-balancing) losses the MoE layers of a forward add:
``MoeLayer`` calls :meth:`MoeContext.add_loss`, ``MoeLoss`` reads :meth:`MoeContext.get_loss`
and clears it.
"""

from __future__ import annotations

import torch

from colossal.legacy.context.parallel_context import global_context as gpc
from colossal.legacy.context.parallel_mode import ParallelMode

__all__ = ["MOE_CONTEXT", "MoeContext", "moe_env"]


class MoeContext:
    """The job's MoE groups (read from ``gpc``) and the pending auxiliary losses."""

    def __init__(self) -> None:
        self._losses: list[torch.Tensor] = []

    @property
    def is_initialized(self) -> bool:
        """Whether the job was launched with ``parallel=dict(moe=dict(size=E))``."""
        return gpc.is_initialized(ParallelMode.MOE_MODEL)

    @property
    def model_parallel_size(self) -> int:
        """Ranks sharing one copy of the experts (``E`` of ``moe=dict(size=E)``; 1 without)."""
        return gpc.get_world_size(ParallelMode.MOE_MODEL) if self.is_initialized else 1

    @property
    def data_parallel_size(self) -> int:
        """Ranks holding the same experts (``data parallel size / E``; 1 without MoE)."""
        return gpc.get_world_size(ParallelMode.MOE_DATA) if self.is_initialized else 1

    @property
    def max_ep_size(self) -> int:
        """ColossalAI's later name of :attr:`model_parallel_size`."""
        return self.model_parallel_size

    def add_loss(self, loss: torch.Tensor) -> None:
        """Add one MoE layer's auxiliary loss of the current forward."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"add_loss takes a tensor, got {type(loss).__name__}")
        self._losses.append(loss)

    def get_loss(self) -> torch.Tensor:
        """The sum of the auxiliary losses added since the last reset (0 when none)."""
        if not self._losses:
            return torch.zeros(())
        total = self._losses[0]
        for loss in self._losses[1:]:
            total = total + loss
        return total

    def reset_loss(self) -> None:
        """Drop the pending auxiliary losses (ColossalAI calls it before each forward)."""
        self._losses = []

    @property
    def num_pending_losses(self) -> int:
        """Auxiliary losses added since the last reset."""
        return len(self._losses)


#: The job's MoE environment: ``from colossalai.global_variables import moe_env``.
moe_env = MoeContext()
#: ColossalAI's later name of :data:`moe_env` (``from colossalai.context import MOE_CONTEXT``).
MOE_CONTEXT = moe_env
