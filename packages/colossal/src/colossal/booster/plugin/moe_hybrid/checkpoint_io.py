"""Checkpoint IO of MoeHybridParallelPlugin: experts gathered from their ep ranks.

The hybrid checkpoint IO writes each tensor from its first data-parallel replica. Under
expert parallelism the experts differ along dp: an expert parameter's ``ep`` ranks each hold
a block of its experts (recorded as ``Placement("ep", Block...)``), and its first replica is
the rank with ``moe_dp`` coordinate 0. So this rank offers its dense tensors when it is dp
rank 0, its expert blocks when it is moe_dp rank 0, and the saver gathers every expert into
the one format every plugin (and ``from_pretrained``) reads; loading reads each held block.

Optimizer states go the same way: :class:`~colossal.zero.MoeLowLevelZeroOptimizer`'s two ZeRO
parts are renumbered as the wrapped optimizer's parameters, an expert's state placed along
``ep`` (its block) and ``dp`` (its moe_dp range), gathered from both to its writer.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import StateDict

from colossal.booster.plugin.hybrid.checkpoint_io import HybridCheckpointIO
from colossal.core import OptimizerWrapper, ShardedTensor
from colossal.zero import (
    MoeLowLevelZeroOptimizer,
    StateRef,
    is_expert_param,
    moe_sharded_params,
    moe_sharded_state_dict,
)

__all__ = ["MoeCheckpointIO"]


class MoeCheckpointIO(HybridCheckpointIO):
    """Model and optimizer checkpoints in the one format under ep x dp (x tp x pp).

    Args:
        dense_writer: Whether this rank is dp rank 0 (it offers the dense tensors).
        expert_writer: Whether this rank is moe_dp rank 0 (it offers its experts' blocks).
        layout: ``(tp_size, pp_size)``.
        pp_group: The pipeline group (None without pipeline parallelism).
    """

    def __init__(
        self,
        dense_writer: bool,
        expert_writer: bool,
        layout: tuple[int, int] = (1, 1),
        pp_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(True, layout, pp_group)
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

    def optimizer_state(self, optimizer: OptimizerWrapper) -> StateDict:
        """Both ZeRO parts' states by the wrapped optimizer's indices (sharded: ``StateRef``)."""
        if isinstance(optimizer, MoeLowLevelZeroOptimizer):
            return dict(moe_sharded_state_dict(optimizer))
        return super().optimizer_state(optimizer)

    def optimizer_layout(self, optimizer: OptimizerWrapper) -> dict[int, ShardedTensor]:
        """Each trainable parameter's part this rank keeps, by the wrapped optimizer's index."""
        if isinstance(optimizer, MoeLowLevelZeroOptimizer):
            return dict(moe_sharded_params(optimizer))
        return super().optimizer_layout(optimizer)

    def zero_refs(self, optimizer: OptimizerWrapper) -> Mapping[int, StateRef]:
        """Both ZeRO parts' kept ranges, by the wrapped optimizer's index."""
        if isinstance(optimizer, MoeLowLevelZeroOptimizer):
            return moe_sharded_params(optimizer)
        return super().zero_refs(optimizer)
