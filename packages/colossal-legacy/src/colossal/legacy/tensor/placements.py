"""The DTensor placements of a (process group, distributed spec) pair."""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from colossal.legacy.tensor.distspec import DistPlacementPattern, ShardSpec, _DistSpec
from colossal.legacy.tensor.process_group import ProcessGroup

__all__ = ["placements_of", "spec_of"]


def placements_of(pg: ProcessGroup, spec: _DistSpec, ndim: int) -> tuple[Placement, Placement]:
    """``(dp placement, tp placement)``: always Replicate over dp; the spec over tp.

    Raises:
        ValueError: ``num_partitions`` is not ``pg.tp_world_size()``, or the dim is out of range.
        TypeError: ``spec`` is not a ``ShardSpec`` / ``ReplicaSpec``.
    """
    if not isinstance(spec, _DistSpec):
        raise TypeError(f"a dist spec is ShardSpec(...) or ReplicaSpec(), got {spec!r}")
    if spec.placement is DistPlacementPattern.REPLICATE:
        return Replicate(), Replicate()
    assert isinstance(spec, ShardSpec)
    parts, dim = spec.num_partitions[0], spec.dims[0]
    if parts != pg.tp_world_size():
        raise ValueError(
            f"ShardSpec num_partitions={parts} must equal the ProcessGroup's tp_degree "
            f"({pg.tp_world_size()}); pass ShardSpec([{dim}], [pg.tp_world_size()])"
        )
    if not -ndim <= dim < ndim:
        raise ValueError(
            f"ShardSpec dim {dim} is out of range for a {ndim}-d tensor; "
            f"use a dim in [{-ndim}, {ndim - 1}]"
        )
    return Replicate(), Shard(dim % ndim)


def spec_of(placements: tuple[Placement, ...], tp: int) -> _DistSpec:
    """The distributed spec of DTensor ``placements`` on a ``("dp", "tp")`` mesh."""
    from colossal.legacy.tensor.distspec import ReplicaSpec

    tp_placement = placements[1]
    if isinstance(tp_placement, Shard):
        return ShardSpec([tp_placement.dim], [tp])
    return ReplicaSpec()
