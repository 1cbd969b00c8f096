"""The plain torch modules the dispatching layers start from (and return without TP).

ColossalAI's layers took ``weight_initializer`` / ``bias_initializer``: callables
``init(tensor, fan_in=..., fan_out=...)`` (its ``colossalai.nn.init`` functions). They are
applied here to the whole tensor in torch's layout, before any mode shards it, so every
mode holds parts of the same whole weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["Initializer", "init_linear", "native_linear"]

#: ColossalAI's initializer: ``init(tensor, fan_in=..., fan_out=...)`` fills ``tensor``.
Initializer = Callable[..., object]


def init_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    fan_in: int,
    fan_out: int,
    weight_initializer: Initializer | None,
    bias_initializer: Initializer | None,
) -> None:
    """Apply ColossalAI-style initializers (None: keep torch's initialization)."""
    with torch.no_grad():
        if weight_initializer is not None:
            weight_initializer(weight, fan_in=fan_in, fan_out=fan_out)
        if bias is not None and bias_initializer is not None:
            bias_initializer(bias, fan_in=fan_in)


def native_linear(
    in_features: int,
    out_features: int,
    bias: bool,
    dtype: torch.dtype | None,
    weight_initializer: Initializer | None = None,
    bias_initializer: Initializer | None = None,
) -> nn.Linear:
    """``nn.Linear(in_features, out_features)``, initialized by the given initializers."""
    linear = nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
    init_linear(
        linear.weight, linear.bias, in_features, out_features, weight_initializer, bias_initializer
    )
    return linear
