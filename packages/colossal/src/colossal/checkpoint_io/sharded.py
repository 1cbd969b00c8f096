"""What checkpoint IO sees of any tensor: a :class:`colossal.core.ShardedTensor`.

:func:`as_sharded` turns whatever a plugin hands over into the protocol: sharded states that
implement it already (ZeRO's ``StateRef``) pass through, FSDP2's ``DTensor`` gets the
:class:`DTensorShard` adapter, a tensor marked with :func:`colossal.core.mark_sharded` (a
tensor-parallel parameter, or a copy of one made by :func:`marked_state_dict`) is the
:class:`colossal.core.LocalShard` it is marked as, and a plain tensor is
:class:`colossal.core.Replicated`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from colossal.core import (
    Block,
    Replicated,
    ShardedTensor,
    TensorBacked,
    mark_sharded,
    shard_spec,
    sharded_view,
)
from colossal.core.comm import recv, send

logger = logging.getLogger(__name__)

__all__ = ["DTensorShard", "as_sharded", "is_sharded", "marked_like", "marked_state_dict"]


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed tensors
        return None
    return DTensor


def is_sharded(value: Any) -> bool:
    """Whether ``value`` is a tensor of which a rank may hold only a part (not a plain one)."""
    if isinstance(value, ShardedTensor):
        return True
    if isinstance(value, torch.Tensor) and shard_spec(value) is not None:
        return True
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(value, dtensor)


def as_sharded(value: Any) -> ShardedTensor:
    """``value`` as a :class:`colossal.core.ShardedTensor`.

    Raises:
        TypeError: ``value`` is neither a tensor nor a sharded tensor.
    """
    if isinstance(value, ShardedTensor):
        return value
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(value, dtensor):
        return DTensorShard(value)
    if isinstance(value, torch.Tensor):
        view = sharded_view(value)
        return Replicated(value) if view is None else view
    raise TypeError(
        f"expected a tensor or a colossal.core.ShardedTensor, got {type(value).__name__}"
    )


def marked_like(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``tensor`` carrying ``like``'s :func:`colossal.core.mark_sharded` record, if any.

    ``tensor`` must be laid out like ``like`` (its detached copy, its gradient or an optimizer
    state of it); it is returned itself, marked when ``like`` is.
    """
    spec = shard_spec(like)
    if spec is not None and shard_spec(tensor) is None:
        mark_sharded(tensor, spec.part, spec.shape, spec.group)
    return tensor


def marked_state_dict(module: nn.Module) -> dict[str, Any]:
    """``module.state_dict()`` whose entries keep their parameters' sharding marks.

    A plain ``state_dict()`` detaches every tensor, which drops the record
    :func:`colossal.core.mark_sharded` keeps on a parameter; here each entry is detached too
    (the same tensors ``state_dict()`` gives) and then marked as its parameter was, so
    checkpoint IO sees a tensor-parallel parameter as the part of the whole tensor it holds.
    """
    state = module.state_dict(keep_vars=True)
    return {
        name: marked_like(value.detach(), value) if isinstance(value, torch.Tensor) else value
        for name, value in state.items()
    }


class DTensorShard(TensorBacked):
    """A ``DTensor`` on a 1-D mesh (FSDP2) as a :class:`colossal.core.ShardedTensor`.

    ``Shard(d)`` holds a :class:`colossal.core.Block` of indices along ``d`` (torch's even
    split: ``ceil(n / world)`` each, the last ranks fewer or none); ``Replicate()`` holds all.

    Args:
        tensor: The DTensor (``shape`` and ``dtype`` are its global ones).

    Raises:
        NotImplementedError: Other meshes or placements (several mesh dims, partial sums).
    """

    def __init__(self, tensor: Any) -> None:
        from torch.distributed.tensor import Replicate, Shard

        self.tensor = tensor
        placements = tuple(tensor.placements)
        if len(placements) != 1 or not isinstance(placements[0], Shard | Replicate):
            raise NotImplementedError(
                f"checkpoints of a DTensor with placements {placements} are not supported; "
                "use one Shard(dim) or Replicate() placement on a 1-D mesh"
            )
        self._part = _block_of(tensor, placements[0])
        self._sharded = isinstance(placements[0], Shard) and tensor.dim() > 0

    @property
    def part(self) -> Block:
        """The block of the global tensor this rank's local tensor holds."""
        return self._part

    def local(self) -> torch.Tensor:
        """This rank's local tensor (shares storage with the DTensor)."""
        return self.tensor.to_local()

    def gather(self, dst: int | None = None) -> torch.Tensor | None:
        """The full CPU tensor on global rank ``dst`` (every rank when None); collective.

        With ``dst`` only that rank receives: every other rank sends it its block (point to
        point over the mesh's group), so no rank but ``dst`` holds the whole tensor.

        Raises:
            ValueError: ``dst`` is not a rank of the DTensor's mesh.
        """
        if dst is None:
            return self.tensor.full_tensor().cpu()  # every rank joins the all-gather
        mesh = self.tensor.device_mesh
        ranks = mesh.mesh.flatten().tolist()
        if dst not in ranks:
            raise ValueError(f"dst={dst} is not a rank of the DTensor's mesh {ranks}")
        rank = dist.get_rank()
        mine = self._part.real(self.local()).contiguous()
        if not self._sharded:  # replicated: dst has it already
            return mine.cpu() if rank == dst else None
        group = mesh.get_group()
        if rank != dst:
            if mine.numel():
                send(mine, dst=dst, group=group)
            return None
        full = mine.new_empty(self.shape)
        for index, holder in enumerate(ranks):
            part = _block_of(self.tensor, self.tensor.placements[0], index)
            if part.numel == 0:
                continue
            if holder == rank:
                part.put(full, mine)
            else:
                received = mine.new_empty(part.sizes)
                recv(received, src=holder, group=group)
                part.put(full, received)
        return full.cpu()

    def wrap(self, local: torch.Tensor) -> Any:
        """A DTensor laid out like this one, holding ``local`` (this rank's part)."""
        from torch.distributed.tensor import DTensor

        mine = self.tensor.to_local()
        return DTensor.from_local(
            local.to(mine.device).reshape(mine.shape),
            self.tensor.device_mesh,
            self.tensor.placements,
            shape=self.tensor.shape,
            stride=self.tensor.stride(),
            run_check=False,
        )

    def __repr__(self) -> str:
        return f"DTensorShard(shape={tuple(self.shape)}, part={self._part})"


def _block_of(tensor: Any, placement: Any, rank: int | None = None) -> Block:
    """The block that mesh rank ``rank`` (this rank when None) holds of ``tensor``."""
    from torch.distributed.tensor import Shard

    shape = tuple(tensor.shape)
    if not isinstance(placement, Shard) or not shape:
        return Block.whole(shape)
    dim = placement.dim % len(shape)
    mesh = tensor.device_mesh
    world = mesh.size()
    rank = mesh.get_local_rank() if rank is None else rank
    chunk = -(-shape[dim] // world)
    lo = min(shape[dim], rank * chunk)
    return Block.along(shape, dim, lo, min(shape[dim], lo + chunk))
