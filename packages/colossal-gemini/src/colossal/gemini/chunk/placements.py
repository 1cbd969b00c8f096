"""How Gemini places what a rank keeps of each parameter: its piece of a chunk shard.

A parameter's placements are those recorded on it (:func:`colossal.core.mark_sharded`: a
tensor-parallel block, ...), then this rank's flat range of the parameter's local tensor
along the chunks' data-parallel axis (``"dp"``), then, with extra data parallelism, the
replicas of that shard (``"dp_replicate"``). Checkpoint IO and the gradient norm read them.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from colossal.core import (
    FlatRange,
    ImpliedAxes,
    Placement,
    Replicate,
    param_placements,
)
from colossal.core.grad_norm import NormTerm, norm_term
from colossal.core.sharded import shard_spec
from colossal.gemini.chunk.chunk import Chunk
from colossal.gemini.chunk.manager import ChunkManager

__all__ = [
    "DP_AXIS",
    "ChunkGroups",
    "REPLICA_AXIS",
    "norm_group",
    "piece_norm_terms",
    "piece_placements",
    "whole_shape",
]

DP_AXIS = "dp"
"""The axis the chunks are sharded along."""
REPLICA_AXIS = "dp_replicate"
"""The axis of extra data parallelism (replicas of the shards)."""


class ChunkGroups(Protocol):
    """The groups chunks are laid out over: a :class:`ChunkManager`, or a stand-in."""

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The chunks' (data-parallel) group; None: the whole job."""
        ...

    @property
    def extra_dp_size(self) -> int:
        """Replicas of every shard (extra data parallelism); 1 without."""
        ...

    @property
    def extra_dp_group(self) -> dist.ProcessGroup | None:
        """The group of a shard's replicas."""
        ...


def piece_placements(
    chunk: Chunk, param: nn.Parameter, manager: ChunkGroups, implied: ImpliedAxes | None = None
) -> tuple[Placement, ...]:
    """The placements of this rank's piece of ``param`` in ``chunk``."""
    start, stop = chunk.shard_range(param)
    out = [*param_placements(param, implied), Placement(DP_AXIS, FlatRange(start, stop),
                                                        manager.group)]
    if getattr(manager, "extra_dp_size", 1) > 1:
        out.append(Placement(REPLICA_AXIS, Replicate(), manager.extra_dp_group))
    return tuple(out)


def whole_shape(chunk: Chunk, param: nn.Parameter) -> torch.Size:
    """Shape of the whole tensor ``param`` is (a part of): its record's, else as chunked.

    (A managed parameter's own tensor may be an empty placeholder; the chunk knows its shape.)
    """
    spec = shard_spec(param)
    return torch.Size(spec.shape) if spec is not None else torch.Size(chunk.infos[param].shape)


def norm_group(
    manager: ChunkManager, implied: ImpliedAxes | None = None
) -> dist.ProcessGroup | None:
    """The group the gradient norm is reduced over.

    The chunks' group, or the whole job when a parameter lies along other axes too (or the
    shards have replicas).
    """
    params = [p for chunk in manager.chunks for p in chunk.params]
    if implied or getattr(manager, "extra_dp_size", 1) > 1 or any(
        shard_spec(p) is not None for p in params
    ):
        return None
    return manager.group


def piece_norm_terms(
    chunks: list[Chunk], manager: ChunkGroups, group: dist.ProcessGroup | None,
    implied: ImpliedAxes | None = None,
) -> list[list[tuple[int, int, NormTerm]]]:
    """Per chunk, ``(offset in the shard, length, term)`` of each parameter's piece."""
    out = []
    for chunk in chunks:
        pieces = []
        for param in chunk.params:
            start, stop = chunk.shard_range(param)
            if start == stop:
                continue
            at = chunk.infos[param].offset + start - chunk.shard_begin
            placements = piece_placements(chunk, param, manager, implied)
            term = norm_term(placements, whole_shape(chunk, param), group)
            pieces.append((at, stop - start, term))
        out.append(pieces)
    return out
