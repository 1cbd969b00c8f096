"""Distributed specs: how a ``ColoTensor`` lies over the tensor-parallel ranks.

``ShardSpec(dims, num_partitions)`` splits one dimension over the tp ranks (torch's
``Shard(dim)``: ``ceil(n / tp)`` rows each, the last ranks fewer when it does not divide);
``ReplicaSpec()`` keeps the whole tensor on every tp rank (``Replicate()``).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum

__all__ = ["DistPlacementPattern", "ReplicaSpec", "ShardSpec"]


class DistPlacementPattern(Enum):
    """The two layouts over the tp ranks."""

    REPLICATE = "r"
    SHARD = "s"


class _DistSpec:
    """Base of the two specs (compared by value)."""

    placement: DistPlacementPattern
    dims: tuple[int, ...] = ()
    num_partitions: tuple[int, ...] = ()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _DistSpec):
            return NotImplemented
        return (self.placement, self.dims, self.num_partitions) == (
            other.placement,
            other.dims,
            other.num_partitions,
        )

    def __hash__(self) -> int:
        return hash((self.placement, self.dims, self.num_partitions))


class ReplicaSpec(_DistSpec):
    """The whole tensor on every tensor-parallel rank."""

    placement = DistPlacementPattern.REPLICATE

    def __repr__(self) -> str:
        return "ReplicaSpec()"


class ShardSpec(_DistSpec):
    """One dimension split over the tensor-parallel ranks.

    Args:
        dims: The split dimension, as a one-element list (negative counts from the end).
        num_partitions: The number of parts, as a one-element list; must be the
            ``ProcessGroup``'s ``tp_world_size()`` (checked where the spec meets the group).

    Raises:
        ValueError: Not exactly one dim, or a part count below 1.
    """

    placement = DistPlacementPattern.SHARD

    def __init__(self, dims: Sequence[int], num_partitions: Sequence[int]) -> None:
        dims, parts = tuple(dims), tuple(num_partitions)
        if len(dims) != 1 or len(parts) != 1:
            raise ValueError(
                f"ShardSpec splits one dim: got dims={list(dims)}, "
                f"num_partitions={list(parts)}; pass e.g. ShardSpec([-1], [pg.tp_world_size()])"
            )
        if not all(isinstance(v, int) for v in dims + parts) or parts[0] < 1:
            raise ValueError(
                f"ShardSpec needs int dims and positive int num_partitions, got "
                f"dims={list(dims)}, num_partitions={list(parts)}"
            )
        self.dims = dims
        self.num_partitions = parts

    def __repr__(self) -> str:
        return f"ShardSpec(dims={list(self.dims)}, num_partitions={list(self.num_partitions)})"
