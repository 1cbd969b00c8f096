"""Checkpoint IO of MoeHybridParallelPlugin: experts gathered from their ep ranks.

The hybrid checkpoint IO writes each tensor from its first data-parallel replica. Under
expert parallelism the experts differ along dp: an expert parameter's ``ep`` ranks each hold
a block of its experts (recorded as ``Placement("ep", Block...)``), and its first replica is
the rank with ``moe_dp`` coordinate 0. So this rank offers its dense tensors when it is dp
rank 0, its expert blocks when it is moe_dp rank 0, and the saver gathers every expert into
the one format every plugin (and ``from_pretrained``) reads; loading reads each held block.
"""

from __future__ import annotations

import torch
from torch import nn

from colossal.booster.plugin.hybrid.checkpoint_io import HybridCheckpointIO
from colossal.core import OptimizerWrapper
from colossal.zero import is_expert_param

__all__ = ["MoeCheckpointIO"]


class MoeCheckpointIO(HybridCheckpointIO):
    """Model checkpoints in the one format under ep x dp.

    Args:
        dense_writer: Whether this rank is dp rank 0 (it offers the dense tensors).
        expert_writer: Whether this rank is moe_dp rank 0 (it offers its experts' blocks).
    """

    def __init__(self, dense_writer: bool, expert_writer: bool) -> None:
        super().__init__(True, (1, 1), None)
        self.dense_writer = dense_writer
        self.expert_writer = expert_writer
        self._saving = False

    def model_state(self, model: nn.Module) -> dict[str, object]:
        """Every tensor of the model as this rank's part (experts from their moe_dp rank 0)."""
        self._saving = True
        try:
            return super().model_state(model)
        finally:
            self._saving = False

    def _held(self, model: nn.Module) -> dict[str, torch.Tensor]:
        held = super()._held(model)
        if not self._saving:  # loading: every rank reads into every tensor it holds
            return held
        return {
            name: value
            for name, value in held.items()
            if (self.expert_writer if is_expert_param(value) else self.dense_writer)
        }

    def save_optimizer(
        self,
        optimizer: OptimizerWrapper,
        checkpoint: str,
        shard: bool = False,
        size_per_shard: int = 1024,
        use_async: bool = False,
        background_snapshot: bool = False,
    ) -> None:
        """Not supported yet under MoeHybridParallelPlugin.

        Raises:
            NotImplementedError: always; save the model, or ``optimizer.state_dict()``.
        """
        raise NotImplementedError(
            "MoeHybridParallelPlugin does not save optimizer checkpoints yet; save the model "
            "(booster.save_model) or torch.save(optimizer.state_dict()) per rank"
        )

    def load_optimizer(self, optimizer: OptimizerWrapper, checkpoint: str) -> None:
        """Not supported yet under MoeHybridParallelPlugin.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(
            "MoeHybridParallelPlugin does not load optimizer checkpoints yet; load the model "
            "(booster.load_model) or optimizer.load_state_dict(...) per rank"
        )
