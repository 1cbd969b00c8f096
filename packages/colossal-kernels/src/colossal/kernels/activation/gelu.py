"""The tanh approximation of GELU as one fused kernel, and a swap for composed versions."""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

logger = logging.getLogger(__name__)

__all__ = ["FusedGELUTanh", "gelu_tanh", "replace_activations"]

TANH_GELU_CLASSES = frozenset(
    {"NewGELUActivation", "FastGELUActivation", "GELUTanh", "PytorchGELUTanh"}
)
"""Class names of transformers' modules that compute ``0.5 x (1 + tanh(sqrt(2/pi) (x +
0.044715 x^3)))`` (matched by name: colossal-kernels does not import transformers)."""


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` in one kernel (and one backward)."""
    return F.gelu(x, approximate="tanh")


class FusedGELUTanh(nn.Module):
    """Module form of :func:`gelu_tanh`, a drop-in for GPT-2's ``gelu_new`` and its kin."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the tanh-approximate GELU."""
        return gelu_tanh(x)


def replace_activations(model: nn.Module) -> int:
    """Swap every composed tanh-GELU module in ``model`` for :class:`FusedGELUTanh`, in place.

    Only parameter-free modules whose class is one of :data:`TANH_GELU_CLASSES` are replaced
    (the same function, rounded differently: within a few float32 ulps). Other activations,
    including exact (erf) GELU, are left alone.

    Returns:
        How many modules were replaced.
    """
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__ not in TANH_GELU_CLASSES:
                continue
            if any(True for _ in child.parameters()) or any(True for _ in child.buffers()):
                logger.debug("not replacing %s: it holds parameters or buffers", name)
                continue
            fused = FusedGELUTanh()
            fused.train(child.training)
            setattr(parent, name, fused)
            count += 1
    return count
