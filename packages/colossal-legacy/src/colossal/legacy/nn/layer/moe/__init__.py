"""ColossalAI's ``colossalai.nn.layer.moe``: experts, MoE layer, routers, noise.

The seeds' page "Integrate Mixture-of-Experts Into Your Model"::

    noisy_func = NormalNoiseGenerator(num_experts)
    router = Top2Router(capacity_factor, noisy_func=noisy_func)
    experts = Experts(expert=VanillaFFN, num_experts=num_experts, d_model=..., d_ff=...)
    ffn = MoeLayer(dim_model=d_model, num_experts=num_experts, router=router, experts=experts)

Experts are split over ``gpc``'s ``MOE_MODEL`` group (``parallel=dict(moe=dict(size=E))``).
"""

from colossal.legacy.nn.layer.moe.layers import Experts, MoeLayer, moe_group
from colossal.legacy.nn.layer.moe.routers import (
    NormalNoiseGenerator,
    Top1Router,
    Top2Router,
    UniformNoiseGenerator,
)
from colossal.legacy.nn.loss.moe import MoeCrossEntropyLoss, MoeLoss

__all__ = [
    "Experts",
    "MoeCrossEntropyLoss",
    "MoeLayer",
    "MoeLoss",
    "NormalNoiseGenerator",
    "Top1Router",
    "Top2Router",
    "UniformNoiseGenerator",
    "moe_group",
]
