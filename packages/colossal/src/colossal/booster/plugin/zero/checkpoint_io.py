"""ZeroCheckpointIO: the checkpoint IO of :class:`LowLevelZeroPlugin`.

Optimizer checkpoints never hold the whole state on one rank: ZeRO's sharded states are
:class:`colossal.core.ShardedTensor` (``colossal.zero.StateRef``), so saving gathers each
parameter's state only to the rank writing it, and loading reads only the rows of each
stored tensor that cover this rank's elements.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from colossal.checkpoint_io import CheckpointIO, TensorReader
from colossal.checkpoint_io.optimizer_state import SKIP_ON_LOAD
from colossal.checkpoint_io.sharded import TensorLike
from colossal.core import LocalShard, OptimizerWrapper, ShardedTensor
from colossal.zero import LowLevelZeroOptimizer, sharded_params, sharded_state_dict

logger = logging.getLogger(__name__)

__all__ = ["ZeroCheckpointIO"]


class ZeroCheckpointIO(CheckpointIO):
    """Checkpoint IO of ZeRO: sharded optimizer saves and loads, masters kept in sync.

    Args:
        group: The ranks that write and read together (the whole job when None).
    """

    keep_states = SKIP_ON_LOAD  # the fp32 masters, when saved

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        super().__init__(group)
        self.optimizers: list[LowLevelZeroOptimizer] = []

    def load_model_state(
        self, model: nn.Module, targets: Mapping[str, TensorLike], reader: TensorReader
    ) -> None:
        """Copy tensors in, then refresh the masters of every optimizer over this model."""
        super().load_model_state(model, targets, reader)
        params = list(model.parameters())
        for opt in self.optimizers:
            if any(opt.manages(p) for p in params):
                opt.sync_masters_from_params()

    def optimizer_state(self, optimizer: OptimizerWrapper) -> dict[str, Any]:
        """Per-parameter states; ZeRO's sharded ones as ``StateRef`` (gathered when written)."""
        if isinstance(optimizer, LowLevelZeroOptimizer):
            return sharded_state_dict(optimizer)
        return super().optimizer_state(optimizer)

    def optimizer_layout(self, optimizer: OptimizerWrapper) -> dict[int, ShardedTensor]:
        """ZeRO: the flat range of each trainable parameter this rank keeps."""
        if isinstance(optimizer, LowLevelZeroOptimizer):
            return dict(sharded_params(optimizer))
        return super().optimizer_layout(optimizer)

    def load_state_value(self, layout: ShardedTensor, local: torch.Tensor) -> LocalShard:
        """This rank's elements, as the part of the state ZeRO's loader accepts."""
        return LocalShard(local.reshape(-1), layout.placements, layout.shape)
