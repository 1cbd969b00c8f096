"""What checkpoint IO sees of any tensor: a :class:`colossal.core.ShardedTensor`.

:func:`as_sharded` turns whatever a plugin hands over into the protocol: sharded states that
implement it already (ZeRO's ``StateRef``) pass through, a ``DTensor`` (FSDP2) is a
:class:`colossal.core.DTensorShard` (one placement per mesh dimension), a tensor marked
with :func:`colossal.core.mark_sharded` (a tensor-parallel parameter, or a copy of one made
by :func:`marked_state_dict`) is the
:class:`colossal.core.LocalShard` it is marked as, and a plain tensor is
:class:`colossal.core.Replicated`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from colossal.core import (
    DTensorShard,
    Replicated,
    ShardedTensor,
    mark_sharded,
    shard_spec,
    sharded_view,
)

logger = logging.getLogger(__name__)

__all__ = [
    "DTensorShard",
    "TensorLike",
    "as_sharded",
    "is_sharded",
    "marked_like",
    "marked_state_dict",
]

TensorLike = torch.Tensor | ShardedTensor
"""A tensor as checkpoint IO receives it: a plain (or marked, or DTensor) tensor, or a
:class:`colossal.core.ShardedTensor` (see :func:`as_sharded`)."""


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed tensors
        return None
    return DTensor


def is_sharded(value: object) -> bool:
    """Whether ``value`` is a tensor of which a rank may hold only a part (not a plain one)."""
    if isinstance(value, ShardedTensor):
        return True
    if isinstance(value, torch.Tensor) and shard_spec(value) is not None:
        return True
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(value, dtensor)


def as_sharded(value: object) -> ShardedTensor:
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
        mark_sharded(tensor, spec.placements, spec.shape)
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
