"""Name registry: the model name of every parameter an optimizer holds.

The names are taken when the optimizer is boosted (:func:`group_param_names`) and carried by
its :class:`colossal.core.OptimizerWrapper` (``param_names``); checkpoints store optimizer
states under them.
"""

from __future__ import annotations

from torch import nn
from torch.optim import Optimizer

from colossal.core import OptimizerWrapper

__all__ = ["group_param_names", "param_names"]


def param_names(optimizer: OptimizerWrapper) -> list[str]:
    """The model name of each optimizer index (param groups in order, flattened).

    Raises:
        TypeError: ``optimizer`` is not a boosted optimizer (no names carried).
    """
    names = optimizer.param_names if isinstance(optimizer, OptimizerWrapper) else None
    if names is None:
        raise TypeError(
            f"{type(optimizer).__name__} carries no parameter names; pass the optimizer "
            "returned by booster.boost(...)"
        )
    return [n for group in names for n in group]


def group_param_names(optimizer: Optimizer, model: nn.Module) -> list[list[str]]:
    """The model name of each param group's parameters (for ``OptimizerWrapper``).

    Raises:
        ValueError: The optimizer holds a parameter that is not in ``model``.
    """
    by_id = {id(p): n for n, p in model.named_parameters()}
    names = []
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in by_id:
                raise ValueError(
                    f"optimizer param group {g} holds a parameter of shape {tuple(p.shape)} "
                    "that is not in the model; build the optimizer from model.parameters()"
                )
        names.append([by_id[id(p)] for p in group["params"]])
    return names
