"""Attention with mask descriptions and backend dispatch."""

from colossal.kernels.attention.cpu_causal import (
    causal_block_size,
    causal_flash_attention,
    causal_flash_backward,
    causal_flash_forward,
    tiled_causal_block,
    tiled_causal_supported,
)
from colossal.kernels.attention.mask import AttentionMask, AttnMaskType, make_attention_mask
from colossal.kernels.attention.sdpa import attention, eager_attention, sdpa_backends

__all__ = [
    "AttentionMask",
    "AttnMaskType",
    "attention",
    "causal_block_size",
    "causal_flash_attention",
    "causal_flash_backward",
    "causal_flash_forward",
    "eager_attention",
    "make_attention_mask",
    "sdpa_backends",
    "tiled_causal_block",
    "tiled_causal_supported",
]
