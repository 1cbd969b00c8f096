"""What every mode-dispatched layer shares: the mode, the groups, seeding, whole state dicts.

A dispatching name (``Linear``, ``LayerNorm``...) is a class whose ``__new__`` returns the
module of the config's tensor mode (:class:`ModeDispatch`), so a model holds the mode's
module directly: its parameter names and ``state_dict`` keys are torch's (``dense_1.weight``,
not ColossalAI's ``dense_1.module.weight``), and a plain model's state dict loads into it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn
from torch.distributed import ProcessGroup

from colossal.core import ParallelDims, shard_spec
from colossal.core.comm import broadcast_object
from colossal.legacy.context import ParallelMode
from colossal.legacy.context.layer_env import LayerEnv
from colossal.legacy.core import gpc
from colossal.shardformer.layer import enable_full_state_dict

__all__ = [
    "GRID_MODES",
    "PLAIN_MODES",
    "ModeDispatch",
    "agreed",
    "check_mode",
    "grid_dims",
    "layer_env",
    "tensor_mode",
    "tp_group_1d",
    "whole_state",
]

#: Modes whose layers are plain torch modules (activations whole on every rank).
PLAIN_MODES: tuple[str | None, ...] = (None, "sequence")
#: Modes whose layers come from ``colossal.shardformer.layer.tp2d`` / ``tp2p5d`` / ``tp3d``.
GRID_MODES = ("2d", "2.5d", "3d")
_KNOWN = (*PLAIN_MODES, "1d", *GRID_MODES)

_M = TypeVar("_M", bound=nn.Module)


class ModeDispatch(type):
    """Metaclass of the dispatching names: ``isinstance`` checks the modes' module types.

    A class using it lists the types its ``__new__`` can return in ``_kinds``.
    """

    _kinds: tuple[type, ...] = ()

    def __instancecheck__(cls, instance: object) -> bool:
        return isinstance(instance, cls._kinds)


def tensor_mode(name: str) -> str | None:
    """The config's tensor mode, checked to be one the layers know.

    Raises:
        NotImplementedError: A custom mode (its layers are the user's own).
    """
    mode = gpc.tensor_parallel_mode
    if mode not in _KNOWN:
        raise NotImplementedError(
            f"colossalai.nn.{name} has no layer for tensor mode {mode!r}; the modes are "
            f"{list(_KNOWN)} (a custom mode builds its own layers)"
        )
    return mode


def check_mode(name: str, mode: str | None, supported: tuple[str | None, ...]) -> None:
    """Raise NotImplementedError unless ``mode`` is in ``supported``."""
    if mode not in supported:
        raise NotImplementedError(
            f"colossalai.nn.{name} is not available in tensor mode {mode!r}; it is in "
            f"{list(supported)}"
        )


def layer_env() -> LayerEnv:
    """The context's :class:`LayerEnv` (``parallel_input``, the 3D orientation)."""
    return gpc.layer_env


def grid_dims() -> ParallelDims:
    """The job's layout (what the 2D/2.5D/3D layers take as ``dims``)."""
    return gpc.dims


def tp_group_1d() -> ProcessGroup:
    """The 1D tensor-parallel group."""
    return gpc.get_group(ParallelMode.PARALLEL_1D)


def agreed(factory: Callable[[], _M], group: ProcessGroup) -> _M:
    """``factory()`` under a seed drawn on the group's first rank and shared with the group.

    The global RNG advances by one draw on every rank and is otherwise left as it was, so
    the ranks of a tensor group build the same native module (collective over ``group``).
    """
    seed = int(torch.randint(0, 2**62, ()).item())
    ranks = torch.distributed.get_process_group_ranks(group)
    if len(ranks) > 1:
        seed = int(broadcast_object(seed, src=ranks[0], group=group))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return factory()


def whole_state(module: _M) -> _M:
    """``module`` with whole tensors in ``state_dict`` when any of its tensors is a part.

    See :func:`colossal.shardformer.layer.enable_full_state_dict`; a module of whole
    (unmarked) tensors is returned unchanged.
    """
    if any(shard_spec(t) is not None for t in module.parameters()):
        enable_full_state_dict(module)
    return module
