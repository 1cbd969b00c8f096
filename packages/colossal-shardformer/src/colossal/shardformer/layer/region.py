"""Entering the tensor-parallel region once for several column-parallel projections.

Megatron's ``f`` (identity forward, all-reduce of the gradient backward) belongs at the point
where a replicated activation starts feeding column-parallel layers. When q, k and v each did
it on their own, the backward would all-reduce three gradients; :func:`enter_tp_region` does it
once on the module's hidden-state input and tags the result, so a column-parallel layer fed
that exact tensor skips its own all-reduce.

The tagged tensor's gradient is all-reduced as a whole, so inside the hooked module it must
feed only column-parallel layers of the same group (anything replicated reading it would have
its gradient summed over the group).

With sequence parallelism (``split_gather``) the entry is switched per module by
:func:`set_region_sequence_parallel`: the hook then all-gathers the sequence shards instead
(and reduce-scatters the gradient), Megatron-SP's entry of the region.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.utils.hooks import RemovableHandle

from colossal.shardformer.layer._primitives import (
    copy_to_tp_region,
    gather_sequence_to_tp,
    mark_tp_region,
)
from colossal.shardformer.layer._utils import group_size

__all__ = ["enter_tp_region", "has_tp_region_entry", "set_region_sequence_parallel"]

_ENTRY_ATTR = "_colossal_tp_region_entry"
_SEQUENCE_ATTR = "_colossal_region_sequence_parallel"


def has_tp_region_entry(module: nn.Module) -> bool:
    """Whether :func:`enter_tp_region` hooked ``module``."""
    return getattr(module, _ENTRY_ATTR, False)


def set_region_sequence_parallel(module: nn.Module, state: object) -> None:
    """Switch ``module``'s region entry to the sequence all-gather (None: back to TP only).

    Args:
        module: A module hooked by :func:`enter_tp_region`.
        state: The sequence-parallel state (any object; its ``batch_size`` attribute, when
            set, unflattens a ``(batch * seq, hidden)`` input), or None to switch off.

    Raises:
        ValueError: ``module`` has no tensor-parallel region entry.
    """
    if not has_tp_region_entry(module):
        raise ValueError(
            f"{type(module).__name__} has no tensor-parallel region entry; hook it with "
            "enter_tp_region first"
        )
    setattr(module, _SEQUENCE_ATTR, state)


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

    def enter(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
        state = getattr(mod, _SEQUENCE_ATTR, None)
        if state is None:
            return mark_tp_region(copy_to_tp_region(x, process_group), process_group)
        batch = getattr(state, "batch_size", None)
        return mark_tp_region(gather_sequence_to_tp(x, process_group, batch), process_group)

    def hook(
        mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if group_size(process_group) == 1:
            return None
        if isinstance(kwargs.get("hidden_states"), torch.Tensor):
            kwargs = {**kwargs, "hidden_states": enter(mod, kwargs["hidden_states"])}
            return args, kwargs
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                return (*args[:i], enter(mod, a), *args[i + 1 :]), kwargs
        return None

    setattr(module, _ENTRY_ATTR, True)
    return module.register_forward_pre_hook(hook, with_kwargs=True)
