"""Entering the tensor-parallel region once for several column-parallel projections.

Megatron's ``f`` (identity forward, all-reduce of the gradient backward) belongs at the point
where a replicated activation starts feeding column-parallel layers. When q, k and v each did
it on their own, the backward would all-reduce three gradients; :func:`enter_tp_region` does it
once on the module's hidden-state input and tags the result, so a column-parallel layer fed
that exact tensor skips its own all-reduce.

The tagged tensor's gradient is all-reduced as a whole, so inside the hooked module it must
feed only column-parallel layers of the same group (anything replicated reading it would have
its gradient summed over the group).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.utils.hooks import RemovableHandle

from colossal.shardformer.layer._primitives import copy_to_tp_region, mark_tp_region
from colossal.shardformer.layer._utils import group_size

__all__ = ["enter_tp_region"]


def enter_tp_region(module: nn.Module, process_group: ProcessGroup | None) -> RemovableHandle:
    """Make ``module``'s hidden-state input enter the TP region of ``process_group`` once.

    Registers a forward pre-hook replacing the ``hidden_states`` keyword argument when given,
    else the first positional tensor, by ``copy_to_tp_region(x, process_group)`` tagged for the
    column-parallel layers. With a group of one rank the hook changes nothing.

    Args:
        module: The module whose input feeds column-parallel projections (an attention block).
        process_group: The tensor-parallel group (the whole job when None).

    Returns:
        The hook's handle (``handle.remove()`` undoes it).

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"enter_tp_region needs an nn.Module, got {type(module).__name__}")

    def enter(x: torch.Tensor) -> torch.Tensor:
        return mark_tp_region(copy_to_tp_region(x, process_group), process_group)

    def hook(
        mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if group_size(process_group) == 1:
            return None
        if isinstance(kwargs.get("hidden_states"), torch.Tensor):
            kwargs = {**kwargs, "hidden_states": enter(kwargs["hidden_states"])}
            return args, kwargs
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                return (*args[:i], enter(a), *args[i + 1 :]), kwargs
        return None

    return module.register_forward_pre_hook(hook, with_kwargs=True)
