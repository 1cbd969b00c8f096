"""Small helpers shared by the parallel layers: group size and rank, divisibility checks."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = [
    "check_divisible",
    "check_embedding_flags",
    "group_rank",
    "group_size",
    "src_rank",
]


def group_size(group: ProcessGroup | None) -> int:
    """Ranks in ``group`` (the whole job when None); 1 when torch.distributed is not set up."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    """This process's rank inside ``group``; 0 when torch.distributed is not set up."""
    if not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def src_rank(group: ProcessGroup | None) -> int:
    """The global rank of ``group``'s first member (what ``broadcast`` takes as ``src``)."""
    if group is None or group is dist.GroupMember.WORLD:
        return 0
    return dist.get_global_rank(group, 0)


def check_divisible(what: str, size: int, tp: int, module: str, fix: str) -> None:
    """Raise ValueError unless ``size`` splits evenly over ``tp`` ranks.

    Args:
        what: Name of the dimension (``"out_features"``).
        size: Its size.
        tp: The tensor-parallel size.
        module: The layer being built, for the message.
        fix: What the caller can do about it.
    """
    if size % tp != 0:
        raise ValueError(
            f"{module}: {what}={size} is not divisible by the tensor-parallel size {tp}; {fix}"
        )


def check_embedding_flags(module: object, owner: str) -> None:
    """Raise ValueError if the native embedding ``module`` uses a flag a split one cannot honour.

    Args:
        module: The native ``nn.Embedding``.
        owner: The layer being built, for the message.
    """
    for flag in ("max_norm", "scale_grad_by_freq", "sparse"):
        if getattr(module, flag, None):
            raise ValueError(
                f"{owner}: the native embedding sets {flag}={getattr(module, flag)!r}, which a "
                "sharded embedding does not support; leave it unset"
            )
