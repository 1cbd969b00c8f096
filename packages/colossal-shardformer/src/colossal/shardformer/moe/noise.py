"""Router noise (ColossalAI's ``NormalNoiseGenerator`` and ``UniformNoiseGenerator``).

A router applies its ``noisy_func`` to the gate logits in training only.
"""

from __future__ import annotations

import torch


class NormalNoiseGenerator:
    """Add noise drawn from ``N(0, 1 / E**2)`` to the logits (``E``: the number of experts).

    Args:
        num_experts: Number of experts ``E``; the noise' scale is ``1 / E**2``.
    """

    def __init__(self, num_experts: int) -> None:
        if num_experts < 1:
            raise ValueError(f"num_experts must be positive, got {num_experts}")
        self.scale = 1.0 / num_experts**2

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        """``inputs + n`` with ``n ~ N(0, scale)`` elementwise."""
        return inputs + torch.randn_like(inputs) * self.scale


class UniformNoiseGenerator:
    """Multiply the logits by a factor drawn uniformly from ``[1 - eps, 1 + eps)`` (Mesh TF).

    Args:
        eps: Half-width of the factor's interval.
    """

    def __init__(self, eps: float = 1e-2) -> None:
        if not 0.0 <= eps < 1.0:
            raise ValueError(f"eps must lie in [0, 1), got {eps}")
        self.eps = eps

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        """``inputs * u`` with ``u ~ U[1 - eps, 1 + eps)`` elementwise."""
        factor = 1.0 - self.eps + 2.0 * self.eps * torch.rand_like(inputs)
        return inputs * factor
