"""A DTensor sharding strategy for CPU flash attention (``scaled_dot_product_attention``).

torch has no DTensor strategy for ``aten._scaled_dot_product_flash_attention_for_cpu`` (the
kernel ``F.scaled_dot_product_attention`` takes on CPU), so transformers' ``sdpa`` attention
raised inside a ColoTensor model. Attention is independent per batch row and per head: on
each mesh dimension the op accepts q, k, v all replicated, or all split along the batch
(dim 0) or the heads (dim 1); its outputs are laid out alike. A mask (padding) stays
replicated, so it joins a split only along a dimension where it has size 1 (broadcast).
The backward op gets the same rule. Registered on import (by ``colossal.legacy.tensor``).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

__all__: list[str] = []

_aten = torch.ops.aten


def _mask(mask: object, dim: int | None) -> list[object] | None:
    """The mask's placements for a strategy splitting ``dim`` (None: all replicated).

    ``[]`` without a mask; ``None`` when the strategy cannot take it: a mask stays replicated
    (a plain mask made inside the model is not split for a kwarg), so only a mask of size 1
    along ``dim`` (broadcast) joins a split strategy.
    """
    if mask is None:
        return []
    shape = tuple(getattr(mask, "shape", ()))
    if dim is None or (len(shape) == 4 and shape[dim] == 1):
        return [Replicate()]
    return None


@register_sharding(_aten._scaled_dot_product_flash_attention_for_cpu.default)
def _sdpa_forward(
    query: object,
    key: object,
    value: object,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    attn_mask: object = None,
    scale: float | None = None,
) -> list[tuple[list[object], list[object]]]:
    out: list[tuple[list[object], list[object]]] = []
    for dim in (None, 0, 1):
        mask = _mask(attn_mask, dim)
        if mask is not None:
            place = Replicate() if dim is None else Shard(dim)
            out.append(([place, place], [place] * 3 + [None, None] + mask))
    return out


@register_sharding(_aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def _sdpa_backward(
    grad_out: object,
    query: object,
    key: object,
    value: object,
    out: object,
    logsumexp: object,
    dropout_p: float,
    is_causal: bool,
    attn_mask: object = None,
    scale: float | None = None,
) -> list[tuple[list[object], list[object]]]:
    strategies: list[tuple[list[object], list[object]]] = []
    for dim in (None, 0, 1):
        mask = _mask(attn_mask, dim)
        if mask is not None:
            place = Replicate() if dim is None else Shard(dim)
            strategies.append(([place] * 3, [place] * 6 + [None, None] + mask))
    return strategies
