"""``enable_flash_attention``: transformers' attention routed to colossal-kernels' dispatch.

:func:`register_attention` registers :func:`colossal_attention_forward` with transformers'
``AttentionInterface`` (and the matching mask builder with ``AttentionMaskInterface``) under
the name ``"colossal"``; ``model.set_attn_implementation("colossal")`` then makes every
attention module that uses the interface call it. No model code is replaced.

Masks: none (causal when the module is causal, via the kernels' causal kind), a 2-D padding
mask (padded kinds), and a 4-D bool or additive float mask (custom kind). The registered mask
builder (:func:`colossal_mask`) keeps a plain padded causal batch as its 2-D padding mask and
otherwise builds transformers' SDPA mask (``None``, or a 4-D bool mask that already holds
sliding windows, cache offsets and packed sequences).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["ATTENTION_NAME", "colossal_attention_forward", "colossal_mask", "register_attention"]

logger = logging.getLogger(__name__)

ATTENTION_NAME = "colossal"
"""The name the implementation is registered under."""

_UNSUPPORTED = ("softcap", "s_aux", "sinks")


def colossal_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention-function signature transformers calls, over ``colossal.kernels.attention``.

    Args:
        module: The calling attention module (its ``is_causal`` is read).
        query: ``[B, Hq, Sq, D]``.
        key: ``[B, Hk, Sk, D]`` (``Hq`` a multiple of ``Hk``).
        value: ``[B, Hk, Sk, Dv]``.
        attention_mask: None, ``[B, Sk]`` padding mask, or a 4-D bool/additive float mask.
        dropout: Attention dropout probability.
        scaling: Score scale (default ``1/sqrt(D)``).
        is_causal: Overrides ``module.is_causal`` when given.
        **kwargs: Other model arguments; soft-capping and attention sinks are refused.

    Returns:
        ``(output [B, Sq, Hq, Dv], None)`` (no attention weights).

    Raises:
        NotImplementedError: Logit soft-capping or attention sinks were asked for.
    """
    from colossal.kernels import AttentionMask, AttnMaskType, attention, make_attention_mask

    for name in _UNSUPPORTED:
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"{type(module).__name__} passes {name!r}, which the colossal attention does "
                "not implement; set enable_flash_attention=False for this model"
            )
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    sq = query.shape[2]
    if attention_mask is None:
        kind = AttnMaskType.CAUSAL if causal and sq > 1 else AttnMaskType.NONE
        mask = AttentionMask(kind)
    elif attention_mask.dim() == 4:
        mask = AttentionMask(AttnMaskType.CUSTOM, custom=attention_mask)
    else:
        mask = make_attention_mask(attention_mask, is_causal=bool(causal), q_len=sq)
    out = attention(query, key, value, mask, dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def colossal_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable[[int, int, int, int], bool] | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """The mask builder registered with transformers' ``AttentionMaskInterface``.

    Plain causal attention over a whole padded batch (no cache offset, no sliding window,
    no packed sequences) keeps the ``[B, S]`` padding mask, which the attention turns into
    the kernels' padded-causal kind (``None`` when nothing is padded). Everything else gets
    transformers' SDPA mask: ``None`` or a 4-D bool mask (the kernels' custom kind).
    """
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    plain = (
        mask_function is causal_mask_function
        and not kwargs.get("use_vmap", False)
        and attention_mask is not None
        and attention_mask.dim() == 2
        and q_offset == 0
        and kv_offset == 0
        and q_length == kv_length == attention_mask.shape[1]
    )
    if plain:
        assert attention_mask is not None
        mask = attention_mask.bool()
        return None if bool(mask.all()) else mask
    if mask_function is not None:
        kwargs["mask_function"] = mask_function
    return sdpa_mask(
        batch_size,
        q_length,
        kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        attention_mask=attention_mask,
        **kwargs,
    )


def register_attention() -> str:
    """Register the colossal attention with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, colossal_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, colossal_mask)
    return ATTENTION_NAME
