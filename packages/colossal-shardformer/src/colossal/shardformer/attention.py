"""``enable_flash_attention``: transformers' attention routed to colossal-kernels' dispatch.

:func:`register_attention` registers :func:`colossal_attention_forward` with transformers'
``AttentionInterface`` (and the matching mask builder with ``AttentionMaskInterface``) under
the name ``"colossal"``; ``model.set_attn_implementation("colossal")`` then makes every
attention module that uses the interface call it. No model code is replaced.

Masks: none (causal when the module is causal, via the kernels' causal kind), a 2-D padding
mask (padded kinds), and a 4-D bool or additive float mask (custom kind). transformers builds
the mask as for SDPA: ``None`` when plain causal attention suffices, else a 4-D bool mask that
already holds padding, sliding windows and packed sequences.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

__all__ = ["ATTENTION_NAME", "colossal_attention_forward", "register_attention"]

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


def register_attention() -> str:
    """Register the colossal attention with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, colossal_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    return ATTENTION_NAME
