"""Mixture of Experts primitives: routers, losses, expert-parallel dispatch/combine, layers.

Layering: :mod:`.primitives` (autograd all-to-alls through :mod:`colossal.core.comm`) ->
:mod:`.dispatch` (functional dispatch/combine) -> :mod:`.modules` (``MoeLayer``, ``Experts``);
:mod:`.hf_plan` (``apply_expert_parallel`` for Hugging Face MoE models).
"""

from colossal.shardformer.moe.dispatch import DispatchState, combine, dispatch, moe_apply
from colossal.shardformer.moe.grouped import grouped_matmul
from colossal.shardformer.moe.hf_experts import HFExpertParallelExperts
from colossal.shardformer.moe.hf_plan import apply_expert_parallel, find_hf_experts
from colossal.shardformer.moe.losses import load_balancing_loss, router_z_loss, update_balance_bias
from colossal.shardformer.moe.modules import Experts, GroupedExperts, MoeLayer, local_expert_range
from colossal.shardformer.moe.noise import NormalNoiseGenerator, UniformNoiseGenerator
from colossal.shardformer.moe.primitives import all_to_all_uneven, exchange_counts
from colossal.shardformer.moe.routing import (
    RoutingResult,
    Top1Router,
    Top2Router,
    TopKRouter,
    expert_capacity,
)

__all__ = [
    "DispatchState",
    "Experts",
    "GroupedExperts",
    "HFExpertParallelExperts",
    "MoeLayer",
    "NormalNoiseGenerator",
    "RoutingResult",
    "Top1Router",
    "Top2Router",
    "TopKRouter",
    "UniformNoiseGenerator",
    "all_to_all_uneven",
    "apply_expert_parallel",
    "combine",
    "dispatch",
    "exchange_counts",
    "expert_capacity",
    "find_hf_experts",
    "grouped_matmul",
    "load_balancing_loss",
    "local_expert_range",
    "moe_apply",
    "router_z_loss",
    "update_balance_bias",
]
