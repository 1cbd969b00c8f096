"""How ZeRO places what it keeps of each parameter: its slice of the flat bucket.

A parameter's placements are those recorded on it (:func:`colossal.core.mark_sharded`: a
tensor-parallel block, an expert slice, a pipeline stage's ownership), then this rank's flat
range of the parameter's local tensor along the data-parallel axis. The gradient norm and
checkpoint IO read these placements; ZeRO itself needs no other group than its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from colossal.core import FlatRange, Owned, Placement, Replicate, shard_spec
from colossal.core.grad_norm import NormTerm, norm_term

if TYPE_CHECKING:
    from colossal.zero.layout import Bucket, ParamSlot

__all__ = [
    "DP_AXIS",
    "ImpliedAxes",
    "norm_group",
    "param_placements",
    "slice_norm_terms",
    "slice_placements",
    "whole_shape",
]

DP_AXIS = "dp"
"""The axis name of ZeRO's data-parallel slices."""


@dataclass(frozen=True)
class ImpliedAxes:
    """Axes a parameter lies along without saying so.

    They come from ColossalAI's ``tp_process_group`` and ``pp_process_group`` arguments of
    ``LowLevelZeroOptimizer``.
    A parameter whose record names no ``"pp"`` axis is owned by this rank's stage of ``pp``;
    one with no record at all is replicated over ``tp``.

    Attributes:
        tp: The tensor-parallel group, or None.
        pp: The pipeline group, or None.
    """

    tp: dist.ProcessGroup | None = None
    pp: dist.ProcessGroup | None = None

    def __bool__(self) -> bool:
        return self.tp is not None or self.pp is not None


def param_placements(param: torch.Tensor, implied: ImpliedAxes | None = None
                     ) -> tuple[Placement, ...]:
    """The placements of ``param``: its record, with the implied axes it does not name."""
    spec = shard_spec(param)
    own = spec.placements if spec is not None else ()
    if not implied:
        return own
    extra: list[Placement] = []
    if implied.pp is not None and not any(p.axis == "pp" for p in own):
        coordinate = dist.get_rank(implied.pp)
        extra.append(Placement("pp", Owned(coordinate), implied.pp))
    if implied.tp is not None and spec is None:
        extra.append(Placement("tp", Replicate(), implied.tp))
    return (*extra, *own)


def whole_shape(param: torch.Tensor) -> torch.Size:
    """Shape of the whole (unsharded) parameter."""
    spec = shard_spec(param)
    return torch.Size(spec.shape) if spec is not None else param.shape


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
