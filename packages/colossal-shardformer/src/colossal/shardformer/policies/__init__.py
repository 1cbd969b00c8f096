"""Policies: how each model family is sharded, as data.

:class:`Policy` and its descriptions (:class:`ModulePolicyDescription`,
:class:`SubModuleReplacementDescription`) are the data model; :func:`get_autopolicy` picks a
hand-written policy (GPT-2, BERT, ViT, OPT, Bloom) or derives one from the model's
``base_model_tp_plan`` (:class:`TPPlanPolicy`). :func:`lora_policy` wraps a policy so that
peft's LoRA adapters are split with their tensor-parallel base layers.
"""

from colossal.shardformer.policies.auto_policy import get_autopolicy
from colossal.shardformer.policies.base_policy import (
    ModulePolicyDescription,
    Policy,
    SubModuleReplacementDescription,
)
from colossal.shardformer.policies.lora import lora_policy
from colossal.shardformer.policies.tp_plan import TPPlanPolicy, model_tp_plan

__all__ = [
    "ModulePolicyDescription",
    "Policy",
    "SubModuleReplacementDescription",
    "TPPlanPolicy",
    "get_autopolicy",
    "lora_policy",
    "model_tp_plan",
]
