"""Name registry: the model name of every parameter an optimizer holds."""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["param_names", "record_param_names"]


def param_names(optimizer: Any) -> list[str]:
    """The parameter name of each optimizer index, recorded when the optimizer was boosted.

    Raises:
        TypeError: The optimizer was not boosted (no names recorded).
    """
    names = getattr(optimizer, "colossal_param_names", None)
    if names is None:
        raise TypeError(
            f"{type(optimizer).__name__} has no recorded parameter names; pass the optimizer "
            "returned by booster.boost(...)"
        )
    return list(names)


def record_param_names(optimizer: Any, model: nn.Module) -> list[str]:
    """Record on ``optimizer`` the model name of every parameter, in param-group order.

    Raises:
        ValueError: The optimizer holds a parameter that is not in ``model``.
    """
    by_id = {id(p): n for n, p in model.named_parameters()}
    groups = optimizer.param_groups
    names = []
    for g, group in enumerate(groups):
        for p in group["params"]:
            if id(p) not in by_id:
                raise ValueError(
                    f"optimizer param group {g} holds a parameter of shape {tuple(p.shape)} "
                    "that is not in the model; build the optimizer from model.parameters()"
                )
            names.append(by_id[id(p)])
    return names
