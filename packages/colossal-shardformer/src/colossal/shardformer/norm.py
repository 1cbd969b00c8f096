"""``enable_fused_normalization``: swap a model's norms for colossal-kernels' fused ones."""

from __future__ import annotations

import logging

from torch import nn

__all__ = ["replace_norms"]

logger = logging.getLogger(__name__)


def replace_norms(model: nn.Module) -> int:
    """Swap every ``nn.LayerNorm`` and ``*RMSNorm`` in ``model`` for the fused module, in place.

    Parameters are shared with the replaced module (same Parameter objects, so tied weights,
    optimizer state, sharding marks and gradient hooks carry over). Norms the fused kernels
    cannot reproduce (Gemma's ``1 + weight`` RMSNorm) are left as they are.

    Returns:
        How many norms were replaced.
    """
    from colossal.kernels import replace_norms as kernels_replace_norms

    count = kernels_replace_norms(model)
    logger.info("%s: %d norms replaced by fused ones", type(model).__name__, count)
    return count
