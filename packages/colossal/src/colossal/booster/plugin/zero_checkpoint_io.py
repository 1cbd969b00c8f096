"""ZeroCheckpointIO: the checkpoint IO of :class:`LowLevelZeroPlugin`.

Optimizer checkpoints never hold the whole state on one rank: saving gathers each
parameter's state only while the rank writing it needs it, and loading reads only the rows
of each stored tensor that cover this rank's slice.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from colossal.checkpoint_io import CheckpointError, CheckpointIO, TensorReader
from colossal.checkpoint_io.names import param_names
from colossal.checkpoint_io.optimizer_state import named_to_indexed
from colossal.zero import LowLevelZeroOptimizer
from colossal.zero.state_dict import (
    LocalRange,
    StateRef,
    StateSlice,
    gather_param_state,
    local_param_ranges,
    sharded_state_dict,
)

logger = logging.getLogger(__name__)

__all__ = ["ZeroCheckpointIO"]


class ZeroCheckpointIO(CheckpointIO):
    """Checkpoint IO of ZeRO: sharded optimizer saves and loads, masters kept in sync.

    Saving hands the writer placeholders (full shape and dtype, one element of storage) for
    the sharded states; :meth:`to_full` gathers a parameter's state when the saver asks for
    it, and only the rank writing that key keeps it. Loading reads, per state, only the rows
    covering this rank's elements.
    """

    def __init__(self, group: Any = None) -> None:
        super().__init__(group)
        self.optimizers: list[LowLevelZeroOptimizer] = []
        self._refs: dict[tuple[Any, ...], tuple[LowLevelZeroOptimizer, StateRef]] = {}
        self._deferred = False

    def load_model_state(
        self, model: nn.Module, targets: dict[str, torch.Tensor], reader: TensorReader
    ) -> None:
        """Copy tensors in, then refresh the masters of every optimizer over this model."""
        super().load_model_state(model, targets, reader)
        params = list(model.parameters())
        for opt in self.optimizers:
            if any(opt.manages(p) for p in params):
                opt.sync_masters_from_params()

    # ---- save ------------------------------------------------------------------------------
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """Full per-parameter states; inside :meth:`save_optimizer`, placeholders instead.

        The placeholders (full shape and dtype, one element of storage) cost no communication;
        :meth:`to_full` gathers each when the saver asks for it.
        """
        if not self._deferred or not isinstance(optimizer, LowLevelZeroOptimizer):
            return super().optimizer_state(optimizer)
        state = sharded_state_dict(optimizer)
        for entries in state["state"].values():
            for name, value in entries.items():
                if isinstance(value, StateRef):
                    holder = torch.zeros((), dtype=value.dtype).expand(value.shape)
                    self._refs[_placeholder_key(holder)] = (optimizer, value)
                    entries[name] = holder
        return state

    def to_full(self, tensor: torch.Tensor, dst: int | None = None) -> torch.Tensor | None:
        """Gather a placeholder's state (collective); other tensors are returned as they are.

        With ``dst`` (a rank of this IO's group), only that rank receives the state; the
        others get ``None``.
        """
        found = self._refs.get(_placeholder_key(tensor)) if self._refs else None
        if found is None:
            return tensor
        optimizer, ref = found
        return gather_param_state(optimizer, ref, self._optimizer_rank(optimizer, dst))

    def _optimizer_rank(self, optimizer: LowLevelZeroOptimizer, dst: int | None) -> int | None:
        """``dst`` (a rank of this IO's group) as a rank of the optimizer's group, if in it."""
        if dst is None or not dist.is_initialized():
            return dst
        global_rank = dst if self.group is None else dist.get_global_rank(self.group, dst)
        ranks = list(optimizer._dp_ranks)
        return ranks.index(global_rank) if global_rank in ranks else None

    def save_optimizer(self, optimizer: Any, checkpoint: str, *args: Any, **kwargs: Any) -> None:
        """:meth:`CheckpointIO.save_optimizer` that gathers each state only for its writer."""
        self._deferred = True
        try:
            super().save_optimizer(optimizer, checkpoint, *args, **kwargs)
        finally:
            self._deferred = False
            self._refs.clear()

    # ---- load ------------------------------------------------------------------------------
    def load_optimizer_state(
        self, optimizer: Any, meta: dict[str, Any], reader: TensorReader
    ) -> None:
        """Read only this rank's part of each state (and of the fp32 masters when saved).

        Raises:
            CheckpointError: A stored state's shape differs from its parameter's.
        """
        names = param_names(optimizer)
        position = {n: i for i, n in enumerate(names)}
        ranges = local_param_ranges(optimizer)

        def read(param: str, key: str) -> Any:
            return _read_local(reader, key, ranges.get(position[param]))

        state = named_to_indexed(meta, reader.weight_map, names, read, keep=("master_param",))
        optimizer.load_state_dict(state)


def _placeholder_key(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    """Identity of a save placeholder (all strides 0), surviving ``detach()``."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0 or any(tensor.stride()):
        return None
    return (tensor.untyped_storage().data_ptr(), tuple(tensor.shape), tensor.dtype)


def _read_local(reader: TensorReader, key: str, local: LocalRange | None) -> Any:
    """The stored ``key``: whole when not per-parameter, else a :class:`StateSlice`.

    Reads the rows (dim 0) covering ``[local.start, local.stop)`` of the flattened tensor and
    trims them to those elements.
    """
    shape = reader.shape(key)
    if local is None or not shape:
        return reader.read(key)  # scalars (e.g. step) and states of untrained parameters
    if tuple(shape) != local.shape:
        raise CheckpointError(
            f"optimizer state {key!r} has shape {tuple(shape)} in the checkpoint but the "
            f"parameter has {local.shape}: the checkpoint belongs to another model"
        )
    row = math.prod(shape[1:])
    if row == 0 or local.start == local.stop:
        values = reader.read(key, slice(0, 0)).reshape(-1)
        return StateSlice(values, local.start, local.shape)
    first, last = local.start // row, -(-local.stop // row)
    rows = reader.read(key, slice(first, last)).reshape(-1)
    skip = local.start - first * row
    return StateSlice(rows[skip : skip + local.stop - local.start], local.start, local.shape)
