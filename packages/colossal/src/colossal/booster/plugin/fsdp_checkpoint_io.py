"""FSDPCheckpointIO: the checkpoint IO of :class:`TorchFSDPPlugin`.

Full tensors are gathered from the ``DTensor`` shards for saving (written spread over the
ranks) and each rank reads only its rows when loading.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from colossal.checkpoint_io import CheckpointIO, TensorReader
from colossal.checkpoint_io.names import param_names
from colossal.checkpoint_io.optimizer_state import named_to_indexed

logger = logging.getLogger(__name__)

__all__ = ["FSDPCheckpointIO"]


def _local_rows(t: DTensor) -> slice | None:
    """Rows of the full tensor that this rank's dim-0 shard holds (None: not a dim-0 shard)."""
    if len(t.placements) != 1 or t.placements[0] != Shard(0) or t.dim() == 0:
        return None
    mesh = t.device_mesh
    world, rank = mesh.size(), mesh.get_local_rank()
    rows = t.shape[0]
    chunk = -(-rows // world)
    lo = min(rows, rank * chunk)
    return slice(lo, min(rows, lo + chunk))


class FSDPCheckpointIO(CheckpointIO):
    """Gathers full tensors for saving; loads only this rank's rows of each tensor."""

    def to_full(self, tensor: torch.Tensor, dst: int | None = None) -> torch.Tensor:
        """Gather a DTensor on every rank (collective); plain tensors pass through."""
        return _full(tensor)

    def load_model_state(
        self, model: nn.Module, targets: dict[str, torch.Tensor], reader: TensorReader
    ) -> None:
        """Read the rows each rank keeps (``get_slice``) into its local shards."""
        with torch.no_grad():
            for name, target in targets.items():
                target_local, rows = _target(target)
                data = reader.read(name, rows)
                target_local.copy_(data.reshape(target_local.shape))

    def load_optimizer_state(
        self, optimizer: Any, meta: dict[str, Any], reader: TensorReader
    ) -> None:
        """Read each state's rows of this rank and wrap them as DTensors like the params."""
        names = param_names(optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        by_name = dict(zip(names, params, strict=True))

        def read(param_name: str, key: str) -> torch.Tensor:
            param = by_name[param_name]
            if isinstance(param, DTensor) and reader.shape(key) == list(param.shape):
                rows = _local_rows(param)
                if rows is not None:
                    local = reader.read(key, rows).to(param.to_local().device)
                    return DTensor.from_local(
                        local,
                        param.device_mesh,
                        param.placements,
                        shape=param.shape,
                        stride=param.stride(),
                        run_check=False,
                    )
            return reader.read(key)

        optimizer.load_state_dict(named_to_indexed(meta, reader.weight_map, names, read))


def _full(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.full_tensor().cpu()
    return value


def _target(target: torch.Tensor) -> tuple[torch.Tensor, Any]:
    if isinstance(target, DTensor):
        rows = _local_rows(target)
        if rows is None:
            raise NotImplementedError(
                f"loading into a DTensor with placements {target.placements} is not supported"
            )
        return target.to_local(), rows
    return target, None
