"""Mark the axes a parameter is replicated along, so the one gradient norm counts it once.

:func:`colossal.core.grad_norm` counts a piece on every rank unless its placements say
otherwise. Once some parameters carry placements (tensor-parallel parts, pipeline stages),
a parameter replicated over the tensor-parallel group (a LayerNorm, a row-parallel bias) or
over the data-parallel group must say so too, or each replica adds its square: under
pipeline x tensor parallelism the norm came out too large by the replicated share.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from colossal.core import Placement, Replicate, mark_sharded, shard_spec, whole_shape

__all__ = ["mark_replicated_axes"]


def _names_axis(placements: Sequence[Placement], axis: str) -> bool:
    """Whether ``placements`` name ``axis`` or one of its sub-axes (``tp_row`` of ``tp``)."""
    return any(p.axis == axis or p.axis.startswith(axis + "_") for p in placements)


def mark_replicated_axes(model: nn.Module, axes: Sequence[tuple[str, ProcessGroup | None]]) -> int:
    """Mark each parameter of ``model`` replicated along every axis of ``axes`` it does not name.

    Nothing is marked unless some parameter already carries placements (without any, the
    norm is local and needs no marks), and axes of one rank are skipped.

    Args:
        model: The model (this stage's slice under a pipeline).
        axes: ``(axis name, group)`` pairs, e.g. ``("tp", tensor_group)``, ``("dp", data_group)``.

    Returns:
        How many parameters were marked.
    """
    params = list(dict.fromkeys(model.parameters()))
    if not any(shard_spec(p) is not None for p in params):
        return 0
    wide = [(axis, group) for axis, group in axes if dist.get_world_size(group) > 1]
    marked = 0
    for param in params:
        spec = shard_spec(param)
        placements = spec.placements if spec is not None else ()
        extra = [
            Placement(axis, Replicate(), group)
            for axis, group in wide
            if not _names_axis(placements, axis)
        ]
        if extra:
            mark_sharded(param, (*extra, *placements), whole_shape(param))
            marked += 1
    return marked
