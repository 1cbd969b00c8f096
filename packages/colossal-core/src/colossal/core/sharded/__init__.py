"""Sharded state: one protocol for "a tensor of which this rank holds a part".

* :mod:`.parts`: the parts of a tensor (:class:`Block`, :class:`FlatRange`, :class:`Blocks`).
* :mod:`.placement`: one :class:`Placement` per parallel axis, composed into a part.
* :mod:`.protocol`: :class:`ShardedTensor` and the :class:`Placed` base of implementations.
* :mod:`.gather`: gathering a tensor axis by axis.
* :mod:`.local`: :class:`Replicated`, :class:`LocalShard`, :class:`Absent`.
* :mod:`.marks`: placements recorded on parameters (:func:`mark_sharded`).
* :mod:`.norm`: the counting rule of the gradient norm (each element once).
"""

from colossal.core.sharded.dtensor import DTensorShard, dtensor_placements
from colossal.core.sharded.gather import gather_placed, leader_of
from colossal.core.sharded.local import Absent, LocalShard, Replicated, TensorBacked
from colossal.core.sharded.marks import (
    ImpliedAxes,
    ShardSpec,
    mark_sharded,
    param_placements,
    shard_parameter,
    shard_source,
    shard_spec,
    sharded_view,
    whole_shape,
)
from colossal.core.sharded.parts import Block, Blocks, FlatRange, SliceReader
from colossal.core.sharded.placement import (
    LocalPart,
    Nested,
    Owned,
    Placement,
    Replicate,
    compose,
    level_shapes,
)
from colossal.core.sharded.protocol import Placed, ShardedTensor

__all__ = [
    "Absent",
    "Block",
    "Blocks",
    "DTensorShard",
    "FlatRange",
    "ImpliedAxes",
    "LocalPart",
    "LocalShard",
    "Nested",
    "Owned",
    "Placed",
    "Placement",
    "Replicate",
    "Replicated",
    "ShardSpec",
    "ShardedTensor",
    "SliceReader",
    "TensorBacked",
    "compose",
    "dtensor_placements",
    "gather_placed",
    "leader_of",
    "level_shapes",
    "mark_sharded",
    "param_placements",
    "shard_parameter",
    "shard_source",
    "shard_spec",
    "sharded_view",
    "whole_shape",
]
