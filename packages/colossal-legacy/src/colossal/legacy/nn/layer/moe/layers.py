"""ColossalAI's ``Experts`` and ``MoeLayer`` on the job's MoE groups.

Built on :mod:`colossal.shardformer.moe`: the experts of a layer are split over
``gpc``'s ``MOE_MODEL`` group (``E / moe size`` per rank), tokens reach them through the
expert-parallel all-to-alls, and each forward adds the router's load-balancing loss to
``moe_env`` (read by ``MoeLoss``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from colossal.legacy.context.moe_context import moe_env
from colossal.legacy.context.parallel_context import global_context as gpc
from colossal.legacy.context.parallel_mode import ParallelMode
from colossal.legacy.context.random import expert_seed
from colossal.shardformer.moe import Experts as _Experts
from colossal.shardformer.moe import MoeLayer as _MoeLayer
from colossal.shardformer.moe import TopKRouter

__all__ = ["Experts", "MoeLayer", "moe_group"]


def moe_group() -> dist.ProcessGroup | None:
    """The job's MoE model-parallel group (None without ``parallel=dict(moe=...)``)."""
    if gpc.is_initialized(ParallelMode.MOE_MODEL):
        return gpc.get_group(ParallelMode.MOE_MODEL)
    return None


class Experts(_Experts):
    """``E / moe size`` local instances of ``expert(**expert_args)`` (ColossalAI's ``Experts``).

    Global expert ``e`` is built under the seed ``moe seed + e`` (see
    :func:`colossal.legacy.context.random.moe_set_seed`), so the model starts alike under any
    MoE size; torch's global random state is left as it was. Expert parameters carry
    ``moe_param = True`` (ColossalAI's mark; ``MoeGradientHandler`` reduces them over
    ``MOE_DATA``).

    Args:
        expert: The expert module class (e.g. a feed-forward block).
        num_experts: Global experts ``E`` (a multiple of the MoE size).
        all_local: Hold every expert on this rank, ignoring the MoE groups (a one-process
            reference of the same model).
        **expert_args: Passed to ``expert``.

    Raises:
        TypeError: ``expert`` is not an ``nn.Module`` class.
        ValueError: ``num_experts`` does not split over the MoE model-parallel group.
    """

    def __init__(
        self,
        expert: type[nn.Module],
        num_experts: int,
        all_local: bool = False,
        **expert_args: object,
    ) -> None:
        if not (isinstance(expert, type) and issubclass(expert, nn.Module)):
            raise TypeError(f"expert must be an nn.Module class, got {expert!r}")
        if not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
        group = None if all_local else moe_group()
        with torch.random.fork_rng(devices=[]):
            super().__init__(_Placeholder, num_experts, group)
            self.experts = nn.ModuleList(
                _seeded(expert, self.first_expert + i, expert_args)
                for i in range(len(self.experts))
            )
        for param in self.experts.parameters():
            param.moe_param = True  # type: ignore[attr-defined]  # ColossalAI's expert mark


class _Placeholder(nn.Module):
    """Parameterless stand-in the base class builds before the seeded experts replace it."""


def _seeded(expert: type[nn.Module], index: int, args: dict[str, object]) -> nn.Module:
    torch.manual_seed(expert_seed(index))
    return expert(**args)


class MoeLayer(_MoeLayer):
    """ColossalAI's ``MoeLayer(dim_model, num_experts, router, experts)``.

    ``y = sum_j w_j * expert_{e_j}(x)`` over the router's kept choices; every forward adds
    the router's load-balancing loss to ``moe_env`` (``MoeLoss`` adds it to the loss).

    Args:
        dim_model: Hidden size.
        num_experts: Global experts (must equal ``experts.num_experts``).
        router: ``Top1Router`` / ``Top2Router`` (shareable between layers).
        experts: :class:`Experts` (shareable between layers, as WideNet does).
    """

    def __init__(
        self, dim_model: int, num_experts: int, router: TopKRouter, experts: _Experts
    ) -> None:
        if not isinstance(router, TopKRouter):
            raise TypeError(f"router must be a Top1Router/Top2Router, got {type(router).__name__}")
        super().__init__(dim_model, num_experts, router, experts)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Mixture output of ``inputs`` ``[..., dim_model]``; adds the aux loss to ``moe_env``."""
        out = super().forward(inputs)
        if self.router.aux_loss is not None:
            moe_env.add_loss(self.router.aux_loss)
        return out
