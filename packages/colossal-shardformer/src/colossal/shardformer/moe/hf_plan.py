"""Find a Hugging Face MoE model's experts and make them expert-parallel.

The experts come from the config's ``base_model_ep_plan`` (transformers 5: e.g.
``{'layers.*.mlp.experts': 'ep_dispatch_experts', ...}`` for Mixtral, Qwen2/3-MoE, DeepSeek-V3),
whose patterns are relative to the base model (``model.<base_model_prefix>``); without a plan,
every module laid out like Hugging Face's fused experts (3-D ``gate_up_proj`` / ``down_proj``
with ``num_experts`` on dim 0) is taken. Routers, shared experts and everything else stay
replicated.
"""

from __future__ import annotations

import re

import torch.distributed as dist
from torch import nn

from colossal.shardformer.moe.dispatch import ep_size
from colossal.shardformer.moe.hf_experts import HFExpertParallelExperts, fused_layout_problem

__all__ = ["apply_expert_parallel", "find_hf_experts"]

_SUPPORTED = (
    "Hugging Face MoE models with fused experts (gate_up_proj [E, 2F, H], down_proj [E, H, F]) "
    "named in config.base_model_ep_plan: Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3"
)


def _base(model: nn.Module) -> tuple[str, nn.Module]:
    """``(prefix, base model)``: ``model.<base_model_prefix>`` when it exists, else ``model``."""
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if isinstance(prefix, str) and prefix else None
    if isinstance(base, nn.Module):
        return f"{prefix}.", base
    return "", model


def _plan_pattern(plan: dict[str, str]) -> re.Pattern[str]:
    """One regex matching every plan key, ``*`` standing for one dotted name component."""
    parts = [re.escape(key).replace(r"\*", r"[^.]+") for key in plan]
    return re.compile("|".join(f"(?:{p})" for p in parts))


def find_hf_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The Hugging Face fused experts modules of ``model`` as ``(qualified name, module)``.

    Raises:
        ValueError: No ``base_model_ep_plan`` and no fused experts module (names the class and
            the supported families), or a planned experts module of an unsupported layout.
    """
    plan = getattr(getattr(model, "config", None), "base_model_ep_plan", None)
    prefix, base = _base(model)
    found: list[tuple[str, nn.Module]] = []
    if isinstance(plan, dict) and plan:
        pattern = _plan_pattern(plan)
        for name, module in base.named_modules():
            if not name or pattern.fullmatch(name) is None:
                continue
            if isinstance(module, HFExpertParallelExperts):
                continue  # already expert-parallel
            problem = fused_layout_problem(module)
            if problem is not None:
                raise ValueError(
                    f"{prefix}{name} ({type(module).__name__}) of {type(model).__name__} is in "
                    f"base_model_ep_plan but cannot run expert-parallel: {problem}; "
                    f"supported: {_SUPPORTED}"
                )
            found.append((prefix + name, module))
        return found
    for name, module in model.named_modules():
        if not isinstance(module, HFExpertParallelExperts) and fused_layout_problem(module) is None:
            found.append((name, module))
    if not found and not any(isinstance(m, HFExpertParallelExperts) for m in model.modules()):
        raise ValueError(
            f"{type(model).__name__} has no base_model_ep_plan in its config and no fused "
            f"experts module, so it has nothing to split over ep; supported: {_SUPPORTED}"
        )
    return found


def apply_expert_parallel(model: nn.Module, ep_group: dist.ProcessGroup | None) -> list[str]:
    """Replace each Hugging Face fused experts module of ``model`` by an expert-parallel one.

    Each replacement (:class:`HFExpertParallelExperts`) keeps this rank's ``E / ep`` experts'
    slices of ``gate_up_proj`` / ``down_proj`` (and biases) under the same parameter names,
    marked ``Placement("ep", Block.along(whole, 0, start, stop), ep_group)``, and runs the same
    ``forward(hidden_states, top_k_index, top_k_weights)`` with dispatch/combine over
    ``ep_group``. Routers, shared experts, attention and embeddings are untouched (replicated).
    The whole experts tensors are released (sliced copies are kept).

    Args:
        model: A Hugging Face MoE model (e.g. ``MixtralForCausalLM``) holding all experts.
        ep_group: The expert-parallel group (None or one rank: all experts stay local).

    Returns:
        The qualified names of the replaced modules (e.g. ``"model.layers.0.mlp.experts"``).

    Raises:
        ValueError: No known experts (names the model class and the supported families), an
            unsupported experts layout, or an ep size not dividing the number of experts.
    """
    found = find_hf_experts(model)
    ep = ep_size(ep_group)
    for name, module in found:
        num_experts = int(getattr(module, "num_experts"))  # noqa: B009 (checked by find)
        if num_experts % ep:
            raise ValueError(
                f"{name} of {type(model).__name__} has {num_experts} experts, which an ep "
                f"group of {ep} ranks does not divide; pick an ep size dividing {num_experts}"
            )
    for name, module in found:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, HFExpertParallelExperts(module, ep_group))
    return [name for name, _ in found]
