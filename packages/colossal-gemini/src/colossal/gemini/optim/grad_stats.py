"""The overflow verdict and the global gradient norm of one step, and the norm type check.

The norm itself is :mod:`colossal.core.grad_norm`'s over each parameter's placements
(:mod:`colossal.gemini.chunk.placements`); an inf or NaN anywhere makes it non-finite, which
is the fp16 overflow verdict.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

logger = logging.getLogger(__name__)

__all__ = ["GradStats", "check_norm_type"]


@dataclass(frozen=True)
class GradStats:
    """What the gradient shards of one step say, agreed over the group.

    Attributes:
        overflow: Some rank's gradient shard holds an inf or NaN.
        norm: The global ``norm_type`` norm of the gradients as they are (still multiplied by
            the loss scale); ``inf`` on overflow.
    """

    overflow: bool
    norm: float


def check_norm_type(norm_type: float) -> float:
    """``norm_type`` as a float, validated.

    Raises:
        ValueError: It is not a positive number or ``inf``.
    """
    if isinstance(norm_type, bool):
        raise ValueError(f"norm_type={norm_type!r} is not a norm; pass e.g. 2.0 or float('inf')")
    try:
        value = float(norm_type)
    except (TypeError, ValueError):
        raise ValueError(
            f"norm_type={norm_type!r} is not a norm; pass e.g. 2.0 or float('inf')"
        ) from None
    if math.isnan(value) or value <= 0:
        raise ValueError(f"norm_type={norm_type!r} is not a norm; pass e.g. 2.0 or float('inf')")
    return value
