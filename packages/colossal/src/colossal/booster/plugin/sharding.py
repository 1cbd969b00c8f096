"""Running Shardformer from a plugin: shard the model, point the optimizer at its parts.

Shared by the plugins that shard with colossal-shardformer (hybrid, Gemini with tensor
parallelism). After Shardformer, a rank holds its stage's chunks (shallow copies of the
model holding only their layers, under the model's own names) with tensor-parallel layers
in place of the originals. The user's optimizer was built on the whole, unsharded model; it
is pointed at the parameters this rank holds by name, where a tied weight answers to every
one of its names (the last stage holds ``lm_head.weight``, which the optimizer knew as the
embedding).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.optim import Optimizer

if TYPE_CHECKING:
    from colossal.shardformer import Policy, ShardConfig

__all__ = [
    "first_names",
    "held_parameters",
    "named_held",
    "repoint_by_alias",
    "shard_and_repoint",
]


def _chunks(module: nn.Module) -> list[nn.Module]:
    return list(module) if isinstance(module, nn.ModuleList) else [module]


def named_held(module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """Every ``(name, parameter)`` this rank holds, tied parameters under each of their names."""
    for chunk in _chunks(module):
        yield from chunk.named_parameters(remove_duplicate=False)


def held_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters this rank holds, each once."""
    return list({id(p): p for _, p in named_held(module)}.values())


def repoint_by_alias(
    optimizer: Optimizer, module: nn.Module, group_names: Sequence[Sequence[Sequence[str]]]
) -> None:
    """Point each param group at the parameters ``module`` holds under one of their names.

    Args:
        optimizer: The optimizer built on the unsharded model (no state yet).
        module: This rank's sharded model (or its chunks).
        group_names: Per group, per original parameter, all names of that parameter.

    Raises:
        ValueError: The optimizer already has state.
    """
    if optimizer.state:
        raise ValueError(
            "boost the optimizer before its first step: its state is not empty, so its "
            "parameters cannot be replaced by the sharded ones"
        )
    held = dict(named_held(module))
    for group, names in zip(optimizer.param_groups, group_names, strict=True):
        params: dict[int, nn.Parameter] = {}
        for aliases in names:
            found = next((held[n] for n in aliases if n in held), None)
            if found is not None:
                params[id(found)] = found
        group["params"] = list(params.values())


def shard_and_repoint(
    model: nn.Module,
    optimizer: Optimizer | None,
    shard_config: ShardConfig,
    policy: Policy | None = None,
) -> tuple[nn.Module, Sequence[Mapping[int, torch.Tensor | None]], list[list[str]]]:
    """Shard ``model`` with Shardformer and point ``optimizer`` at the sharded parameters.

    Returns:
        ``(module, shared, aliases)``: this rank's sharded model (or its chunks), the
        parameters tied across pipeline stages, and every name of each parameter of the
        unsharded model (tied weights have several; the first is the one checkpoints use).
    """
    from colossal.shardformer import ShardFormer

    by_param: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_param.setdefault(id(p), []).append(name)
    group_names = [] if optimizer is None else \
        [[by_param[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    module, shared = ShardFormer(shard_config).optimize(model, policy=policy)
    if optimizer is not None:
        repoint_by_alias(optimizer, module, group_names)
    return module, shared, list(by_param.values())


def first_names(optimizer: Optimizer, module: nn.Module) -> list[list[str]]:
    """Per param group, the first name under which ``module`` holds each parameter."""
    names: dict[int, str] = {}
    for name, p in named_held(module):
        names.setdefault(id(p), name)
    return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
