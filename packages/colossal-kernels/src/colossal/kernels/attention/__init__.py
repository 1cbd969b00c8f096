"""Attention with mask descriptions and backend dispatch."""

from colossal.kernels.attention.mask import AttentionMask, AttnMaskType, make_attention_mask
from colossal.kernels.attention.sdpa import attention, eager_attention, sdpa_backends

__all__ = [
    "AttentionMask",
    "AttnMaskType",
    "attention",
    "eager_attention",
    "make_attention_mask",
    "sdpa_backends",
]
