"""Whole tensors in ``state_dict`` for modules made of sharded parameters.

A parallel layer holds a part of each weight (marked with its placements,
:func:`colossal.core.mark_sharded`). The Booster's checkpoint IO gathers parts itself; a
module used directly (the config-era API: ``model.state_dict()``, ``load_state_dict(plain)``)
needs the same at the module: :func:`enable_full_state_dict` makes ``state_dict()`` return
each marked tensor whole, in torch's layout (what the plain model's state dict holds), and
``load_state_dict`` take each rank's part of a whole tensor. Both are collective: every rank
of the tensors' groups calls them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from colossal.core import Owned, shard_spec
from colossal.core.sharded import gather_placed

__all__ = ["enable_full_state_dict", "full_tensor", "local_part"]


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a marked part (collective), or ``tensor`` itself if unmarked.

    Collective over the axes the tensor is split along; an axis whose one rank owns it (a
    pipeline stage's parameters) is left out: a module's state holds what this rank owns,
    and the other stages, holding other parameters, do not join.
    """
    spec = shard_spec(tensor)
    if spec is None:
        return tensor
    placements = [p for p in spec.placements if not isinstance(p.part, Owned)]
    whole = gather_placed(tensor.detach(), placements, spec.shape, tensor.dtype, None)
    assert whole is not None
    return whole


def local_part(tensor: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``whole`` shaped like the marked ``tensor`` (padding zeroed).

    Raises:
        ValueError: ``whole`` does not have the marked tensor's whole shape.
    """
    spec = shard_spec(tensor)
    if spec is None:
        return whole
    if tuple(whole.shape) != tuple(spec.shape):
        raise ValueError(
            f"a whole tensor of shape {tuple(whole.shape)} was given for a parameter whose "
            f"whole shape is {tuple(spec.shape)}"
        )
    local = torch.zeros_like(tensor)
    part = spec.part
    part.real(local).copy_(part.take(whole.to(local.dtype)).reshape(part.real(local).shape))
    return local


def _gather_hook(
    module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: object
) -> None:
    for kind in ("_parameters", "_buffers"):
        for name, tensor in getattr(module, kind).items():
            key = prefix + name
            if tensor is None or key not in state or shard_spec(tensor) is None:
                continue
            # ``state_dict(keep_vars=True)`` asks for the module's own tensors (checkpoint IO
            # loads into them and reads their marks): those stay this rank's parts.
            if state[key] is not tensor:
                state[key] = full_tensor(tensor)


def _split_hook(
    module: nn.Module,
    state: dict[str, Any],
    prefix: str,
    *args: object,
) -> None:
    for kind in ("_parameters", "_buffers"):
        for name, tensor in getattr(module, kind).items():
            key = prefix + name
            if tensor is None or key not in state or shard_spec(tensor) is None:
                continue
            value = state[key]
            spec = shard_spec(tensor)
            assert spec is not None
            if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(spec.shape):
                state[key] = local_part(tensor, value)


def enable_full_state_dict(module: nn.Module) -> nn.Module:
    """Make ``module.state_dict()`` whole and ``load_state_dict`` split (every submodule).

    A state dict that already holds this rank's parts (the shapes of the local tensors) is
    loaded as is; ``state_dict(keep_vars=True)`` still gives the parameters themselves (marked
    parts), which checkpoint IO saves and loads through the sharded-state protocol. Returns
    ``module``.
    """
    for sub in module.modules():
        if getattr(sub, "_colossal_full_state", False):
            continue
        sub._register_state_dict_hook(_gather_hook)
        sub._register_load_state_dict_pre_hook(_split_hook, with_module=True)
        sub._colossal_full_state = True  # type: ignore[assignment]
    return module
