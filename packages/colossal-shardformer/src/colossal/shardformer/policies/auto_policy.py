"""Pick a policy by model class: hand-written first, then the model's own TP plan.

Hand-written policies live in ``colossal.shardformer.policies.<family>`` modules, each with
``POLICIES: dict[str, type[Policy]]`` (Hugging Face class name -> policy class); they are
imported on first use. Any other model whose config has a ``base_model_tp_plan`` gets a
:class:`~colossal.shardformer.policies.tp_plan.TPPlanPolicy`.
"""

from __future__ import annotations

import importlib
import logging
from functools import lru_cache

from torch import nn

from colossal.shardformer.policies.base_policy import Policy

__all__ = ["HAND_WRITTEN_FAMILIES", "get_autopolicy", "hand_written_policies"]

logger = logging.getLogger(__name__)

HAND_WRITTEN_FAMILIES = ("gpt2", "bert", "vit", "opt", "bloom")
"""Modules under ``colossal.shardformer.policies`` holding hand-written policies."""


@lru_cache(maxsize=1)
def hand_written_policies() -> dict[str, type[Policy]]:
    """Hugging Face class name -> hand-written policy class, merged over the families."""
    merged: dict[str, type[Policy]] = {}
    for family in HAND_WRITTEN_FAMILIES:
        name = f"colossal.shardformer.policies.{family}"
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            logger.debug("no hand-written policy module %s", name)
            continue
        for cls_name, policy in getattr(module, "POLICIES", {}).items():
            if cls_name in merged and merged[cls_name] is not policy:
                raise RuntimeError(
                    f"two hand-written policies claim {cls_name}: {family} and another"
                )
            merged[cls_name] = policy
    return merged


def get_autopolicy(model: nn.Module) -> Policy:
    """A policy instance for ``model``.

    Looks the class name up in the hand-written policies (then its base classes' names),
    else derives one from the model's ``base_model_tp_plan``.

    Raises:
        NotImplementedError: No hand-written policy and no tensor-parallel plan; the
            message names the class and how to pass a custom policy.
    """
    from colossal.shardformer.policies.tp_plan import TPPlanPolicy, model_tp_plan

    policies = hand_written_policies()
    for cls in type(model).__mro__:
        policy = policies.get(cls.__name__)
        if policy is not None:
            logger.debug("%s: hand-written %s", type(model).__name__, policy.__name__)
            return policy()
        if cls is nn.Module:
            break
    if model_tp_plan(model):
        return TPPlanPolicy()
    name = type(model).__name__
    raise NotImplementedError(
        f"no tensor-parallel policy for {name}: it has no hand-written policy (those cover "
        f"{sorted(policies) or list(HAND_WRITTEN_FAMILIES)}) and its config defines no "
        "base_model_tp_plan. Write a Policy subclass describing its layers and pass it: "
        "ShardFormer(shard_config).optimize(model, policy=MyPolicy())"
    )
