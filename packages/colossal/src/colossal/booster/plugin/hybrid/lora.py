"""LoRA (``peft``) under the hybrid-parallel plugin.

Shardformer's policies know the Hugging Face model, not peft's wrapper around it, so the
plugin shards the model inside the ``PeftModel`` (``peft_model.get_base_model()``); its
adapters (``lora_A``/``lora_B`` inside each targeted layer) go with the layers to their
pipeline stage. The base weights are frozen: ZeRO keeps no master weights or states for
them. The boosted model holds this rank's chunks, so it carries a :class:`HybridLoraSource`
that gathers the full adapter (every stage's, under peft's names) for
:func:`colossal.booster.plugin.lora.save_lora_as_pretrained`. The ``PeftModel`` keeps its
module tree (peft reads it to choose what to save) with the other stages' weights emptied.

Under tensor parallelism the adapters are split with their base layers
(:mod:`colossal.shardformer.policies.lora`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from colossal.core import sharded_view

__all__ = ["HybridLoraSource", "peft_parts", "prefixed_aliases", "release_unheld"]


def peft_parts(model: nn.Module) -> tuple[nn.Module, nn.Module | None, str]:
    """``(model to shard, PeftModel or None, name prefix of the former in the latter)``.

    peft is not imported here: a model can only be a ``PeftModel`` if peft is loaded.
    """
    peft = sys.modules.get("peft")
    if peft is None or not isinstance(model, peft.PeftModel):
        return model, None, ""
    inner = model.get_base_model()
    prefix = next(name for name, m in model.named_modules() if m is inner)
    return inner, model, f"{prefix}." if prefix else ""


def prefixed_aliases(aliases: Sequence[Sequence[str]], prefix: str) -> list[list[str]]:
    """Each parameter's names under the ``PeftModel``, then under the sharded model.

    The first (peft's) is the name checkpoints use, as under the other plugins.
    """
    return [[prefix + n for n in names] + list(names) for names in aliases]


def release_unheld(peft_model: nn.Module, chunks: Sequence[nn.Module]) -> None:
    """Empty the weights of ``peft_model`` that ``chunks`` do not hold (other stages').

    The ``PeftModel`` keeps the whole module tree (peft picks the adapter entries to save by
    walking it) but no longer the other stages' tensors.
    """
    held = {id(p) for chunk in chunks for p in chunk.parameters()}
    for p in peft_model.parameters():
        if id(p) not in held:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)


def _full(value: torch.Tensor) -> torch.Tensor:
    """The whole CPU tensor of a (possibly tensor-parallel) state entry (collective)."""
    view = sharded_view(value)
    whole = value if view is None else view.gather()
    if whole is None:  # gather() without a destination returns the tensor on every rank
        raise RuntimeError(f"gathering {view} returned nothing on this rank")
    return whole.detach().cpu()


class HybridLoraSource:
    """The ``PeftModel`` of a boosted hybrid-parallel model and its full adapter.

    Not an ``nn.Module``: set as an attribute of the boosted model, it registers nothing.

    Args:
        peft_model: The ``PeftModel`` given to ``boost``.
        chunks: This rank's sharded chunks of the model inside it.
        prefix: The name prefix of that model in ``peft_model``.
        pp_group: The pipeline group (None without a pipeline).
    """

    def __init__(
        self,
        peft_model: nn.Module,
        chunks: list[nn.Module],
        prefix: str,
        pp_group: dist.ProcessGroup | None,
    ) -> None:
        self.peft_model = peft_model
        self.chunks = chunks
        self.prefix = prefix
        self.pp_group = pp_group

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """Every entry peft saves, as full tensors under peft's names (collective, all ranks).

        Each rank picks its stage's entries, gathers tensor-parallel parts, then the stages
        exchange theirs over the pipeline group.
        """
        from colossal.booster.plugin.lora import _adapter_state

        held: dict[str, torch.Tensor] = {}
        for chunk in self.chunks:
            for name, value in chunk.state_dict(keep_vars=True).items():
                held.setdefault(self.prefix + name, value)
        state = _adapter_state(self.peft_model, held, _full)

        if self.pp_group is None or dist.get_world_size(self.pp_group) == 1:
            return state
        parts: list[Any] = [None] * dist.get_world_size(self.pp_group)
        dist.all_gather_object(parts, state, group=self.pp_group)
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            merged.update(part)
        return merged
