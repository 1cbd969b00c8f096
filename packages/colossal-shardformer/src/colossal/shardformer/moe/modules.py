"""MoE modules: ColossalAI's ``Experts`` and ``MoeLayer`` and fused ``GroupedExperts``.

Expert parameters are marked sharded over the ep group on the expert dimension
(``Placement("ep", Block.along(whole, 0, start, stop), group)``) so the gradient norm and the
checkpoint IO treat them as parts of the whole expert tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from colossal.core import Block, Placement, mark_sharded
from colossal.shardformer.moe.dispatch import ep_size, moe_apply
from colossal.shardformer.moe.grouped import grouped_ffn
from colossal.shardformer.moe.routing import TopKRouter

__all__ = ["Experts", "GroupedExperts", "MoeLayer", "local_expert_range"]


def local_expert_range(num_experts: int, group: dist.ProcessGroup | None) -> tuple[int, int]:
    """Global experts ``[start, stop)`` this rank holds over the ep ``group``."""
    ep = ep_size(group)
    if num_experts % ep:
        raise ValueError(f"{num_experts} experts do not split over an ep group of {ep}")
    local = num_experts // ep
    rank = dist.get_rank(group) if ep > 1 else 0
    return rank * local, (rank + 1) * local


def _mark_ep(param: nn.Parameter, num_experts: int, group: dist.ProcessGroup | None) -> None:
    if ep_size(group) == 1:
        return
    start, stop = local_expert_range(num_experts, group)
    whole = (num_experts, *param.shape[1:])
    mark_sharded(param, Placement("ep", Block.along(whole, 0, start, stop), group), whole)


class GroupedExperts(nn.Module):
    """Local experts as fused 3-D weights, one grouped matmul per projection.

    ``out_e = act(x W1_e) W2_e`` (``gated``: ``act(x Wg_e) * (x Wu_e)`` with ``W1`` holding
    ``[Wg | Wu]``, the Mixtral layout). Parameters ``w1`` ``[E/ep, H, F or 2F]`` and ``w2``
    ``[E/ep, F, H]`` are marked sharded over ``ep`` on dim 0.

    Args:
        num_experts: Global experts ``E``.
        dim_model: ``H``.
        dim_ff: ``F``.
        ep_group: Expert-parallel group (None: all experts local).
        activation: The nonlinearity.
        gated: SwiGLU-style gate.
    """

    def __init__(
        self,
        num_experts: int,
        dim_model: int,
        dim_ff: int,
        ep_group: dist.ProcessGroup | None = None,
        activation: Callable[[torch.Tensor], torch.Tensor] = nn.functional.gelu,
        gated: bool = False,
    ) -> None:
        super().__init__()
        start, stop = local_expert_range(num_experts, ep_group)
        local = stop - start
        self.num_experts = num_experts
        self.ep_group = ep_group
        self.activation = activation
        self.gated = gated
        width = 2 * dim_ff if gated else dim_ff
        self.w1 = nn.Parameter(torch.randn(local, dim_model, width) / math.sqrt(dim_model))
        self.w2 = nn.Parameter(torch.randn(local, dim_ff, dim_model) / math.sqrt(dim_ff))
        _mark_ep(self.w1, num_experts, ep_group)
        _mark_ep(self.w2, num_experts, ep_group)

    def forward(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Outputs of tokens grouped by local expert (``counts[e]`` rows for expert ``e``)."""
        return grouped_ffn(tokens, self.w1, self.w2, counts, self.activation, self.gated)


class Experts(nn.Module):
    """ColossalAI's ``Experts``: ``E / ep`` local instances of ``expert(**expert_args)``.

    Every local expert runs on every step, on zero rows when it gets no token, so each of its
    parameters gets a (zero) gradient.

    Args:
        expert: The expert module class.
        num_experts: Global experts ``E``.
        ep_group: Expert-parallel group (None: all experts local).
        **expert_args: Passed to ``expert``.
    """

    def __init__(
        self,
        expert: type[nn.Module],
        num_experts: int,
        ep_group: dist.ProcessGroup | None = None,
        **expert_args: Any,
    ) -> None:
        super().__init__()
        start, stop = local_expert_range(num_experts, ep_group)
        self.num_experts = num_experts
        self.ep_group = ep_group
        self.first_expert = start
        self.experts = nn.ModuleList(expert(**expert_args) for _ in range(stop - start))

    @property
    def num_local_experts(self) -> int:
        """Experts held on this rank."""
        return len(self.experts)

    def forward(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Outputs of tokens grouped by local expert (``counts[e]`` rows for expert ``e``)."""
        parts = torch.split(tokens, counts)
        return torch.cat([e(part) for e, part in zip(self.experts, parts, strict=True)], dim=0)


class MoeLayer(nn.Module):
    """ColossalAI's ``MoeLayer``: gate, router, expert-parallel dispatch, experts, combine.

    ``y = sum_j w_j * expert_{e_j}(x)`` over the kept choices of the router on the fp32 gate
    logits ``x W_g^T``. The router keeps the last ``aux_loss`` / ``z_loss``.

    Args:
        dim_model: Hidden size ``H``.
        num_experts: Global experts ``E``.
        router: A :class:`TopKRouter` (e.g. ``Top2Router(...)``).
        experts: :class:`Experts` or :class:`GroupedExperts` (their ep group is the layer's).
    """

    def __init__(
        self,
        dim_model: int,
        num_experts: int,
        router: TopKRouter,
        experts: Experts | GroupedExperts,
    ) -> None:
        super().__init__()
        if experts.num_experts != num_experts:
            raise ValueError(f"experts hold {experts.num_experts} experts, the layer {num_experts}")
        self.dim_model = dim_model
        self.num_experts = num_experts
        self.gate_weight = nn.Parameter(torch.randn(num_experts, dim_model) / math.sqrt(dim_model))
        self.router = router
        self.experts = experts

    @property
    def ep_group(self) -> dist.ProcessGroup | None:
        """The expert-parallel group."""
        return self.experts.ep_group

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Mixture output of ``inputs`` ``[..., H]``, same shape and dtype."""
        tokens = inputs.reshape(-1, self.dim_model)
        logits = nn.functional.linear(tokens.float(), self.gate_weight.float())
        routing = self.router(logits)
        out = moe_apply(tokens, routing, self.experts, self.ep_group)
        return out.reshape(inputs.shape).to(inputs.dtype)
