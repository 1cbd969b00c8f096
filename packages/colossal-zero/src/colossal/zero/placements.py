"""How ZeRO places what it keeps of each parameter: its slice of the flat bucket.

A parameter's placements are those recorded on it (:func:`colossal.core.mark_sharded`: a
tensor-parallel block, an expert slice, a pipeline stage's ownership), then this rank's flat
range of the parameter's local tensor along the data-parallel axis. The gradient norm and
checkpoint IO read these placements; ZeRO itself needs no other group than its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from colossal.core import (
    FlatRange,
    ImpliedAxes,
    Placement,
    param_placements,
    shard_spec,
    whole_shape,
)
from colossal.core.grad_norm import NormTerm, norm_term

if TYPE_CHECKING:
    from colossal.zero.layout import Bucket, ParamSlot

__all__ = [
    "DP_AXIS",
    "norm_group",
    "slice_norm_terms",
    "slice_placements",
]

DP_AXIS = "dp"
"""The axis name of ZeRO's data-parallel slices."""


def slice_placements(
    bucket: Bucket, slot: ParamSlot, rank: int, world_size: int,
    group: dist.ProcessGroup | None, implied: ImpliedAxes | None = None,
) -> tuple[Placement, ...]:
    """The placements of ``rank``'s slice of ``slot``'s parameter (its own, then the range)."""
    start, stop = bucket.slot_shard_range(slot, rank, world_size)
    return (*param_placements(slot.param, implied),
            Placement(DP_AXIS, FlatRange(start, stop), group))


def norm_group(params: list[torch.Tensor], dp_group: dist.ProcessGroup | None,
               implied: ImpliedAxes | None = None) -> dist.ProcessGroup | None:
    """The group the norm is reduced over.

    The data-parallel group, or the whole job when any parameter lies along other axes too.
    """
    if implied or any(shard_spec(p) is not None for p in params):
        return None
    return dp_group


def slice_norm_terms(
    buckets: list[Bucket], rank: int, world_size: int, dp_group: dist.ProcessGroup | None,
    group: dist.ProcessGroup | None, implied: ImpliedAxes | None = None,
) -> list[list[tuple[int, int, NormTerm]]]:
    """Per bucket, ``(offset in the rank's slice, length, term)`` of each parameter's piece."""
    out = []
    for bucket in buckets:
        lo, _ = bucket.shard_range(rank, world_size)
        pieces = []
        for slot in bucket.slots:
            start, stop = bucket.slot_shard_range(slot, rank, world_size)
            if start == stop:
                continue
            placements = slice_placements(bucket, slot, rank, world_size, dp_group, implied)
            term = norm_term(placements, whole_shape(slot.param), group)
            pieces.append((slot.offset + start - lo, stop - start, term))
        out.append(pieces)
    return out
