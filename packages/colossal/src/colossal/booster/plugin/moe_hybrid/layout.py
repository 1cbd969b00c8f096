"""Experts next to tensor parallelism: kept out of the TP plan, recorded as replicated over tp.

Under ``tp_size > 1`` the dense layers are split by Shardformer (the model's own
``base_model_tp_plan`` or a policy); the experts are split over ``ep`` instead and every rank
of a tensor-parallel group holds the same experts, runs them on the same tokens and gets the
same gradients. So the TP plan's entries for the experts (``packed_colwise`` /
``moe_tp_experts`` in transformers 5) are dropped, and each expert parameter's placement
record gains ``Placement("tp", Replicate(), tp_group)`` in front: the one gradient norm and
the checkpoint IO then count every expert element once. At ``ep_size == 1`` Hugging Face's
experts stay as they are (unmarked: replicated over tp like any parameter without a record),
and are only kept out of the plan.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from colossal.core import Placement, Replicate, mark_sharded, shard_spec
from colossal.zero import is_expert_param

__all__ = ["drop_expert_tp_plan", "expert_module_names", "mark_experts_replicated"]


def expert_module_names(model: nn.Module) -> list[str]:
    """Qualified names of ``model``'s experts modules.

    Those holding expert-parallel parameters, and (``ep_size == 1``: left as they are, every
    expert on every rank) Hugging Face's fused experts modules.
    """
    from colossal.shardformer.moe import find_hf_experts

    names = [
        name
        for name, module in model.named_modules()
        if any(is_expert_param(p) for p in module.parameters(recurse=False))
    ]
    try:
        names += [name for name, _ in find_hf_experts(model) if name not in names]
    except ValueError:  # a dense model, or experts of a layout the TP plan then refuses
        pass
    return names


def _under(key: str, module: str) -> bool:
    """Whether plan key ``key`` (``*`` = any one component) names ``module`` or a part of it."""
    key_parts, parts = key.split("."), module.split(".")
    if len(key_parts) < len(parts):
        return False
    return all(k in ("*", p) for k, p in zip(key_parts, parts, strict=False))


def drop_expert_tp_plan(model: nn.Module) -> list[str]:
    """Remove the TP plan entries that name ``model``'s expert modules or their parameters.

    The model's plan (``model._tp_plan``, merged from ``config.base_model_tp_plan`` and the
    head's plan) is replaced on the instance by the filtered one, which
    ``colossal.shardformer``'s plan-derived policy reads.

    Returns:
        The removed keys (empty when the model has no plan or no planned experts).
    """
    from colossal.shardformer.policies import model_tp_plan

    plan = model_tp_plan(model)
    experts = expert_module_names(model)
    dropped = [key for key in plan if any(_under(key, name) for name in experts)]
    if dropped:
        model._tp_plan = {k: v for k, v in plan.items() if k not in dropped}  # type: ignore[assignment]
    return dropped


def mark_experts_replicated(model: nn.Module, group: dist.ProcessGroup) -> int:
    """Record every expert parameter of ``model`` as replicated over ``group`` (axis ``tp``).

    Returns:
        How many parameters were marked (an already marked one is left as it is).
    """
    count = 0
    for param in model.parameters():
        spec = shard_spec(param)
        if spec is None or not is_expert_param(param) or spec.axis("tp") is not None:
            continue
        mark_sharded(param, (Placement("tp", Replicate(), group), *spec.placements), spec.shape)
        count += 1
    return count
