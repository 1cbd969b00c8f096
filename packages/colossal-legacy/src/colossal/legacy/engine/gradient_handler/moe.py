"""MoeGradientHandler: expert gradients over MOE_DATA, the rest over DATA.

An expert held by the ranks of one MoE model-parallel group receives tokens of all of
them, so its local gradient already sums their losses' contributions. Summing it over
``MOE_DATA`` (the ranks holding the same expert) then covers every data-parallel rank once;
dividing by the data-parallel size gives the mean over ranks that the other parameters get
from averaging over ``DATA``: the gradients a single process gets from the mean of the
ranks' losses.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.optim import Optimizer

from colossal.core import OptimizerWrapper, Owned, Placement, Replicate, mark_sharded, shard_spec
from colossal.legacy.context.parallel_context import global_context as gpc
from colossal.legacy.context.parallel_mode import ParallelMode
from colossal.legacy.engine.gradient_handler.base import BaseGradientHandler
from colossal.legacy.engine.gradient_handler.data_parallel import average_gradients
from colossal.legacy.registry import GRADIENT_HANDLER
from colossal.shardformer.moe import Experts, GroupedExperts

__all__ = [
    "MoeGradientHandler",
    "expert_parameters",
    "has_moe_parameters",
    "mark_expert_placements",
]


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters of experts: inside ``Experts`` / ``GroupedExperts`` or marked ``moe_param``."""
    found: dict[int, nn.Parameter] = {}
    for module in model.modules():
        if isinstance(module, (Experts, GroupedExperts)):
            for param in module.parameters():
                found[id(param)] = param
    for param in model.parameters():
        if getattr(param, "moe_param", False):
            found[id(param)] = param
    return list(found.values())


def mark_expert_placements(model: nn.Module) -> int:
    """Mark unmarked expert parameters for the one gradient norm: each counts once.

    A local expert is this rank's own within its MOE_MODEL group (``Owned`` along
    ``dp_ep``) and replicated over MOE_DATA (``Replicate`` along ``dp_moe``). Both axes are
    sub-axes of dp, so marking the rest replicated over ``dp`` afterwards leaves experts
    alone. Axes of one rank are skipped; parameters already marked (``GroupedExperts``'
    ``ep`` blocks) are left as they are.

    Returns:
        How many parameters were marked.
    """
    axes: list[Placement] = []
    if gpc.get_world_size(ParallelMode.MOE_DATA) > 1:
        axes.append(Placement("dp_moe", Replicate(), gpc.get_group(ParallelMode.MOE_DATA)))
    if gpc.get_world_size(ParallelMode.MOE_MODEL) > 1:
        owner = gpc.get_local_rank(ParallelMode.MOE_MODEL)
        axes.append(Placement("dp_ep", Owned(owner), gpc.get_group(ParallelMode.MOE_MODEL)))
    if not axes:
        return 0
    marked = 0
    for param in expert_parameters(model):
        if shard_spec(param) is None:
            mark_sharded(param, tuple(axes), param.shape)
            marked += 1
    return marked


def has_moe_parameters(model: nn.Module) -> bool:
    """Whether ``model`` holds expert parameters (``initialize`` then adds the handler)."""
    return bool(expert_parameters(model))


@GRADIENT_HANDLER.register_module
class MoeGradientHandler(BaseGradientHandler):
    """ColossalAI's MoE gradient handler: ``initialize`` adds it to a model with experts.

    Non-expert gradients are averaged over ``DATA``; expert gradients are summed over
    ``MOE_DATA`` and divided by the ``DATA`` size (see the module docstring).

    Args:
        model: The model (its experts found by :func:`expert_parameters`).
        optimizer: Its optimizer.

    Raises:
        RuntimeError: The job has no MoE groups (launch with ``parallel=dict(moe=...)``).
    """

    def __init__(self, model: nn.Module, optimizer: OptimizerWrapper | Optimizer) -> None:
        super().__init__(model, optimizer)
        if not gpc.is_initialized(ParallelMode.MOE_DATA):
            raise RuntimeError(
                "MoeGradientHandler needs the MoE groups: launch with "
                "parallel=dict(moe=dict(size=E))"
            )
        experts = {id(p) for p in expert_parameters(model)}
        params = list(dict.fromkeys(model.parameters()))
        self._experts = [p for p in params if id(p) in experts]
        self._others = [p for p in params if id(p) not in experts]

    def handle_gradient(self) -> None:
        """Average non-expert gradients over DATA, expert ones over every rank's tokens."""
        data = gpc.get_world_size(ParallelMode.DATA)
        if data > 1:
            average_gradients(self._others, gpc.get_group(ParallelMode.DATA))
        moe_dp = gpc.get_world_size(ParallelMode.MOE_DATA)
        if moe_dp > 1:  # average over MOE_DATA, then the ep share: sum / data
            average_gradients(self._experts, gpc.get_group(ParallelMode.MOE_DATA))
        scale = moe_dp / data
        if scale != 1.0:
            with torch.no_grad():
                for param in self._experts:
                    if param.grad is not None:
                        param.grad.mul_(scale)
