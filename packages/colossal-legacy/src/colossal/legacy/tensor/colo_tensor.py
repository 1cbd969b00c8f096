"""``ColoTensor``: the seeds' global tensor, as a thin subclass of torch's ``DTensor``.

Choice: a ColoTensor IS a ``DTensor`` (``isinstance(t, DTensor)``) on its
:class:`ProcessGroup`'s ``("dp", "tp")`` mesh, with the seeds' spec methods on top. DTensor
does the sharding propagation of every operator and every redistribution (differentiable); this
class only maps specs to placements (``ShardSpec([d], [tp])`` -> ``Shard(d)`` over tp,
``ReplicaSpec()`` -> ``Replicate()``, always ``Replicate()`` over dp) and keeps the process
group and compute spec. Operators return plain DTensors (their spec is DTensor's placements).

Differences from the seeds: ``shape`` is the global shape (DTensor's), the payload is
``to_local()`` (the seeds' ``t.data``/``t.shape`` were the local payload); uneven splits follow
torch's ``Shard`` (``ceil(n / tp)`` rows each, the last ranks fewer).
"""

from __future__ import annotations

import copy
from typing import TypeVar

import torch
from torch.distributed.tensor import DTensor

from colossal.core.comm import all_gather_object
from colossal.legacy.tensor.compute_spec import ComputeSpec
from colossal.legacy.tensor.distspec import ReplicaSpec, ShardSpec, _DistSpec
from colossal.legacy.tensor.placements import placements_of, spec_of
from colossal.legacy.tensor.process_group import ProcessGroup
from colossal.legacy.tensor.respec import relayout_
from colossal.legacy.tensor.tensor_spec import ColoTensorSpec

__all__ = ["ColoTensor"]

T = TypeVar("T", bound="ColoTensor")


def _global_shape(local: torch.Tensor, pg: ProcessGroup, dim: int) -> torch.Size:
    """The global shape of tp parts ``local`` split along ``dim`` as torch's ``Shard`` does.

    Raises:
        ValueError: The ranks' part sizes are not torch's split of their sum (on every rank).
    """
    tp = pg.tp_world_size()
    if tp == 1:
        return local.shape
    got = [int(n) for n in all_gather_object(int(local.shape[dim]), pg.tp_process_group())]
    total = sum(got)
    chunk = -(-total // tp)
    want = [max(0, min(chunk, total - k * chunk)) for k in range(tp)]
    if got != want:
        raise ValueError(
            f"the tp ranks' parts along dim {dim} have sizes {got}; torch's Shard split of "
            f"{total} is {want}: build the whole tensor with ReplicaSpec and call "
            "set_dist_spec(ShardSpec(...)) instead"
        )
    shape = list(local.shape)
    shape[dim] = total
    return torch.Size(shape)


class ColoTensor(DTensor):
    """A global tensor over a :class:`ProcessGroup` (a ``DTensor`` with the seeds' specs).

    Build it with :meth:`from_torch_tensor`; the spec is kept as ``process_group``,
    ``dist_spec`` and ``compute_spec``.
    """

    __slots__ = ()  # the same object layout as DTensor, so a DTensor can become one
    process_group: ProcessGroup
    compute_spec: ComputeSpec | None

    @classmethod
    def _adopt(cls: type[T], dt: DTensor, pg: ProcessGroup, compute: ComputeSpec | None) -> T:
        """``dt`` itself, now of class ``cls``, with its process group and compute spec."""
        dt.__class__ = cls
        out: T = dt  # type: ignore[assignment]
        out.process_group = pg
        out.compute_spec = compute
        return out

    @staticmethod
    def from_torch_tensor(tensor: torch.Tensor, spec: ColoTensorSpec | None = None) -> ColoTensor:
        """A ColoTensor whose payload (this rank's part) is ``tensor``; differentiable.

        With ``ShardSpec([d], [tp])``, ``tensor`` is this rank's part along ``d`` (the global
        size is the tp ranks' sum); with ``ReplicaSpec()`` it is the whole tensor, the same on
        every rank. ``spec`` defaults to a replica over ``ProcessGroup()``.

        Raises:
            TypeError: ``tensor`` is not a torch tensor, or already a DTensor.
            ValueError: ``num_partitions`` is not the tp degree; parts not torch's split.
        """
        if not isinstance(tensor, torch.Tensor) or isinstance(tensor, DTensor):
            raise TypeError(
                f"from_torch_tensor takes a plain torch.Tensor (this rank's payload), got "
                f"{type(tensor).__name__}; for a ColoTensor use set_dist_spec instead"
            )
        spec = spec if spec is not None else ColoTensorSpec(ProcessGroup())
        pg = spec.pg
        placements = placements_of(pg, spec.dist_attr, tensor.dim())
        shape = tensor.shape
        if isinstance(spec.dist_attr, ShardSpec):
            shape = _global_shape(tensor, pg, spec.dist_attr.dims[0] % tensor.dim())
        dt = DTensor.from_local(
            tensor,
            pg.mesh,
            placements,
            run_check=False,
            shape=shape,
            stride=_contiguous_stride(shape),
        )
        return ColoTensor._adopt(dt, pg, spec.compute_attr)

    @property
    def dist_spec(self) -> _DistSpec:
        """``ShardSpec`` or ``ReplicaSpec``, read from the DTensor placements."""
        return spec_of(tuple(self.placements), self.process_group.tp_world_size())

    def get_process_group(self) -> ProcessGroup:
        """The :class:`ProcessGroup`."""
        return self.process_group

    def get_tp_world_size(self) -> int:
        """The tensor-parallel degree of the process group."""
        return self.process_group.tp_world_size()

    def get_dp_world_size(self) -> int:
        """The data-parallel degree of the process group."""
        return self.process_group.dp_world_size()

    def is_replicate(self) -> bool:
        """Whether every tp rank holds the whole tensor."""
        return isinstance(self.dist_spec, ReplicaSpec)

    def is_sharded(self) -> bool:
        """Whether the tensor is split over the tp ranks."""
        return isinstance(self.dist_spec, ShardSpec)

    def is_shard_1dcol(self) -> bool:
        """Split along the last dim."""
        spec = self.dist_spec
        return isinstance(spec, ShardSpec) and spec.dims[0] % self.dim() == self.dim() - 1

    def is_shard_1drow(self) -> bool:
        """Split along the first dim."""
        spec = self.dist_spec
        return isinstance(spec, ShardSpec) and spec.dims[0] % self.dim() == 0

    def has_compute_spec(self) -> bool:
        """Whether a compute spec is set."""
        return self.compute_spec is not None

    def has_compute_pattern(self, pattern: object) -> bool:
        """Whether the compute spec's pattern is ``pattern``."""
        return self.compute_spec is not None and self.compute_spec.compute_pattern == pattern

    def set_dist_spec(self: T, dist_spec: _DistSpec) -> T:
        """Re-lay this tensor out as ``dist_spec`` in place (recorded by autograd); returns it.

        Raises:
            ValueError / TypeError: see :func:`placements_of`.
        """
        placements = placements_of(self.process_group, dist_spec, self.dim())
        relayout_(self, self.process_group.mesh, placements)
        return self

    def set_process_group(self: T, pg: ProcessGroup) -> T:
        """Move this tensor to ``pg``'s mesh in place; it must be replicated over tp.

        Raises:
            ValueError: The tensor is sharded.
        """
        if not isinstance(pg, ProcessGroup):
            raise TypeError(f"set_process_group takes a ProcessGroup, got {pg!r}")
        if pg == self.process_group:
            return self
        if not self.is_replicate():
            raise ValueError(
                f"set_process_group needs a replicated tensor, this one is {self.dist_spec}: "
                "call set_dist_spec(ReplicaSpec()) first"
            )
        placements = placements_of(pg, ReplicaSpec(), self.dim())
        relayout_(self, pg.mesh, placements)
        self.process_group = pg
        return self

    def set_tensor_spec(
        self: T, dist_spec: _DistSpec | None, compute_spec: ComputeSpec | None
    ) -> T:
        """Set the distributed spec (in place, if given) and the compute spec; returns self."""
        if dist_spec is not None:
            self.set_dist_spec(dist_spec)
        if compute_spec is not None:
            self.compute_spec = compute_spec
        return self

    def redistribute_spec(self, dist_spec: _DistSpec, pg: ProcessGroup | None = None) -> ColoTensor:
        """A new ColoTensor laid out as ``dist_spec`` (on ``pg``, default its own); differentiable.

        The seeds' ``ColoTensor.redistribute(dist_spec, pg)`` (DTensor's own ``redistribute``
        keeps its torch signature).
        """
        pg = pg if pg is not None else self.process_group
        if pg != self.process_group and not self.is_replicate():
            raise ValueError(
                f"moving to {pg} needs a replicated tensor, this one is "
                f"{self.dist_spec}: redistribute_spec(ReplicaSpec()) first"
            )
        placements = placements_of(pg, dist_spec, self.dim())
        if pg.mesh is self.device_mesh:
            dt = DTensor.redistribute(self, pg.mesh, placements)
        else:
            whole = self.to_local()
            dt = DTensor.from_local(
                whole, pg.mesh, placements_of(pg, ReplicaSpec(), self.dim()), run_check=False
            ).redistribute(pg.mesh, placements)
        return ColoTensor._adopt(dt, pg, self.compute_spec)

    def to_replicate(self) -> ColoTensor:
        """A new ColoTensor holding the whole tensor on every rank; differentiable."""
        return self.redistribute_spec(ReplicaSpec())

    def to_replicate_(self: T) -> T:
        """Make this tensor replicated in place; returns it."""
        return self.set_dist_spec(ReplicaSpec())

    def detach(self: T) -> T:
        """A detached alias of the same class (``nn.Parameter`` and ``Module.to`` need it)."""
        alias = DTensor.detach(self)
        assert isinstance(alias, DTensor)  # DTensor's dispatch wraps every result
        return type(self)._adopt(alias, self.process_group, self.compute_spec)

    def __deepcopy__(self: T, memo: dict[int, object]) -> T:
        """A copy of the payload with the same layout, process group and grad flag."""
        if id(self) in memo:
            return memo[id(self)]  # type: ignore[return-value]
        with torch.no_grad():
            dt = DTensor.from_local(
                self.to_local().clone(),
                self.device_mesh,
                self.placements,
                run_check=False,
                shape=self.shape,
                stride=self.stride(),
            )
        out = type(self)._adopt(dt, self.process_group, copy.deepcopy(self.compute_spec, memo))
        out.requires_grad_(self.requires_grad)
        if getattr(self, "_is_param", False):
            out._is_param = True
        memo[id(self)] = out
        return out

    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"ColoTensor(shape={tuple(self.shape)}, local={self.to_local()}, "
            f"dist_spec={self.dist_spec}, pg={self.process_group}, "
            f"compute_spec={self.compute_spec})"
        )


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    """The row-major strides of ``shape``."""
    stride, out = 1, []
    for size in reversed(shape):
        out.append(stride)
        stride *= max(size, 1)
    return tuple(reversed(out))
