"""``ColoTensorSpec``: a process group, a distributed spec and an optional compute spec."""

from __future__ import annotations

from dataclasses import dataclass, field

from colossal.legacy.tensor.compute_spec import ComputeSpec
from colossal.legacy.tensor.distspec import ReplicaSpec, _DistSpec
from colossal.legacy.tensor.process_group import ProcessGroup

__all__ = ["ColoTensorSpec"]


@dataclass
class ColoTensorSpec:
    """Everything :meth:`ColoTensor.from_torch_tensor` needs to place a tensor.

    Args:
        pg: The :class:`ProcessGroup`.
        dist_attr: :class:`ShardSpec` or :class:`ReplicaSpec` over the tp ranks.
        compute_attr: The :class:`ComputeSpec`, or None.
    """

    pg: ProcessGroup
    dist_attr: _DistSpec = field(default_factory=ReplicaSpec)
    compute_attr: ComputeSpec | None = None
