"""ColossalAI's ``colossalai.tensor.d_tensor`` helpers on Colossal's sharded tensors.

ColossalAI marks a tensor-parallel parameter as a "distributed tensor" (a local shard plus its
layout) and offers helpers to ask about and convert it. Colossal records the same on the
tensor with :func:`colossal.core.mark_sharded` (what Shardformer's layers and
:func:`colossal.core.shard_parameter` do), and torch's ``DTensor`` carries its own layout;
every helper here takes either.

=====================================  ==================================================
ColossalAI                             Colossal
=====================================  ==================================================
``is_distributed_tensor(t)``           a placement record, or a torch ``DTensor``
``is_sharded(t)``                      some axis splits it (not only replicated)
``get_global_shape(t)``                :func:`colossal.core.whole_shape` / ``DTensor.shape``
``get_sharding_spec(t)`` / layout      :class:`colossal.core.ShardSpec` / the placements
``to_global(t)``                       the whole tensor (collective over its axes)
``shard_rowwise`` / ``shard_colwise``  :func:`colossal.core.shard_parameter` (dim 0 / -1)
``distribute_tensor(t, mesh, spec)``   ``torch.distributed.tensor.distribute_tensor``
``sharded_tensor_to_param(t)``         a Parameter keeping the record
=====================================  ==================================================
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DeviceMesh, DTensor, Placement, Shard
from torch.distributed.tensor import distribute_tensor as torch_distribute_tensor

from colossal.core import Block, ShardSpec, mark_sharded, shard_parameter, shard_spec, whole_shape
from colossal.shardformer.layer.full_state import full_tensor

__all__ = [
    "distribute_tensor",
    "get_device_mesh",
    "get_global_shape",
    "get_layout",
    "get_sharding_spec",
    "is_distributed_tensor",
    "is_sharded",
    "shard_colwise",
    "shard_rowwise",
    "sharded_tensor_to_param",
    "to_global",
]


def is_distributed_tensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a part of a larger tensor: marked sharded, or a torch DTensor."""
    return isinstance(tensor, DTensor) or shard_spec(tensor) is not None


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether some axis splits ``tensor`` (a distributed tensor that is not only replicated)."""
    if isinstance(tensor, DTensor):
        return any(isinstance(p, Shard) for p in tensor.placements)
    spec = shard_spec(tensor)
    return spec is not None and not spec.part.is_whole(spec.shape)


def get_global_shape(tensor: torch.Tensor) -> torch.Size:
    """The shape of the whole tensor ``tensor`` is a part of (its own when not distributed)."""
    if isinstance(tensor, DTensor):
        return tensor.shape
    return whole_shape(tensor)


def get_sharding_spec(tensor: torch.Tensor) -> ShardSpec | tuple[Placement, ...]:
    """How ``tensor`` is placed: its :class:`~colossal.core.ShardSpec`, or a DTensor's placements.

    Raises:
        ValueError: ``tensor`` is not a distributed tensor.
    """
    if isinstance(tensor, DTensor):
        return tuple(tensor.placements)
    spec = shard_spec(tensor)
    if spec is None:
        raise ValueError(
            f"a tensor of shape {tuple(tensor.shape)} is not distributed: shard it first "
            "(shard_rowwise / shard_colwise, colossal.core.shard_parameter or a Shardformer layer)"
        )
    return spec


get_layout = get_sharding_spec
"""ColossalAI's ``get_layout``: the same answer as :func:`get_sharding_spec`."""


def get_device_mesh(tensor: torch.Tensor) -> DeviceMesh:
    """A DTensor's device mesh.

    Raises:
        TypeError: ``tensor`` is not a torch DTensor (a marked tensor names process groups in
            its :func:`get_sharding_spec` instead of a mesh).
    """
    if not isinstance(tensor, DTensor):
        raise TypeError(
            "only a torch DTensor has a device mesh; a Colossal sharded tensor records its "
            "process groups: get_sharding_spec(tensor).placements[i].group"
        )
    return tensor.device_mesh


def to_global(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor (collective over the axes ``tensor`` is split along).

    A tensor that is not distributed is returned as it is.
    """
    if isinstance(tensor, DTensor):
        return tensor.full_tensor()
    return full_tensor(tensor)


def _split(
    tensor: torch.Tensor, dim: int, group: dist.ProcessGroup | None, name: str
) -> nn.Parameter:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} shards a tensor, got {type(tensor).__name__}")
    if tensor.dim() == 0:
        raise ValueError(f"{name} needs a tensor of at least one dim, got a scalar")
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    size = tensor.shape[dim]
    if size % world:
        raise ValueError(
            f"{name}: dim {dim} of size {size} does not divide by the group size {world}; "
            "choose a group whose size divides it"
        )
    per = size // world
    part = Block.along(tuple(tensor.shape), dim % tensor.dim(), rank * per, (rank + 1) * per)
    return shard_parameter(tensor, part, group, requires_grad=tensor.requires_grad)


def shard_rowwise(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> nn.Parameter:
    """This rank's part of ``tensor`` split along dim 0 over ``group`` (the job when None).

    Raises:
        ValueError: dim 0 does not divide by the group size.
    """
    return _split(tensor, 0, group, "shard_rowwise")


def shard_colwise(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> nn.Parameter:
    """This rank's part of ``tensor`` split along its last dim over ``group``.

    Raises:
        ValueError: the last dim does not divide by the group size.
    """
    return _split(tensor, -1, group, "shard_colwise")


def distribute_tensor(
    tensor: torch.Tensor, device_mesh: DeviceMesh, sharding_spec: Sequence[Placement]
) -> DTensor:
    """``tensor`` laid out over ``device_mesh`` as ``sharding_spec`` says (a torch DTensor).

    ColossalAI's ``DeviceMesh`` and ``ShardingSpec`` are torch's ``DeviceMesh`` and a sequence
    of placements (``Shard(dim)`` / ``Replicate()``) here.

    Raises:
        TypeError: ``device_mesh`` is not a torch ``DeviceMesh`` or ``sharding_spec`` is not a
            sequence of torch placements.
    """
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(
            f"device_mesh must be a torch.distributed.DeviceMesh, got "
            f"{type(device_mesh).__name__}: build one with init_device_mesh(...)"
        )
    placements = list(sharding_spec) if isinstance(sharding_spec, Sequence) else None
    if not placements or not all(isinstance(p, Placement) for p in placements):
        raise TypeError(
            "sharding_spec must be a sequence of torch placements, e.g. [Shard(0)] or "
            f"[Replicate()], got {sharding_spec!r}"
        )
    return torch_distribute_tensor(tensor, device_mesh, placements)


def sharded_tensor_to_param(tensor: torch.Tensor, requires_grad: bool = True) -> nn.Parameter:
    """A Parameter holding ``tensor``'s data and keeping its placement record.

    Raises:
        ValueError: ``tensor`` is not a distributed tensor.
    """
    if isinstance(tensor, DTensor):
        return nn.Parameter(tensor, requires_grad=requires_grad)
    spec = shard_spec(tensor)
    if spec is None:
        raise ValueError(
            "sharded_tensor_to_param needs a distributed tensor; shard it first "
            "(shard_rowwise / shard_colwise)"
        )
    param = nn.Parameter(tensor.detach(), requires_grad=requires_grad)
    mark_sharded(param, spec.placements, spec.shape)
    return param
