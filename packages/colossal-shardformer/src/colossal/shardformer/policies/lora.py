"""Tensor-parallel LoRA: peft's adapters split consistently with their sharded base layer.

peft wraps each targeted ``nn.Linear`` in a ``lora.Linear`` (``base_layer``, ``lora_A``,
``lora_B``). The policies know the ``nn.Linear``: :func:`lora_policy` derives a policy that
unwraps the targets before the module policy runs (the base layer is sharded as usual) and
wraps them back afterwards, splitting the adapters:

- column-parallel base (``Linear1D_Col``): ``lora_A`` replicated, ``lora_B`` column-parallel.
  ``lora_B``'s input enters the tensor-parallel region, so ``dh`` is all-reduced and
  ``lora_A``'s gradient is whole and equal on the tp ranks. When the layer's input is
  already in the region (a hook all-reduces its gradient once for sibling projections), the
  adapter's input gradient, whole on every rank, is divided by tp before that all-reduce;
- row-parallel base (``Linear1D_Row``): ``lora_A`` row-parallel (its output ``h`` is
  all-reduced), ``lora_B`` replicated.

``lora_dropout`` becomes Shardformer's seeded dropout: one mask over the tp ranks for a
replicated input (else the replicated ``lora_A`` drifts apart), one per rank for a split one.

Replicated adapters carry no placement record: an optimizer told the tensor-parallel group
counts them once in the global gradient norm (replicated over tp). Other parallel base
layers (fused GPT-2 ``Conv1D``, vocabulary-parallel heads) are refused.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn
from torch.distributed import ProcessGroup

if TYPE_CHECKING:
    from colossal.shardformer.policies.base_policy import Policy

_P = TypeVar("_P", bound="Policy")

__all__ = ["lora_policy"]


class RegionInputGrad(nn.Module):
    """Divides the input gradient by tp when the input is in the tensor-parallel region.

    Args:
        group: The tensor-parallel group.
        tp_size: Its size.
    """

    def __init__(self, group: ProcessGroup | None, tp_size: int) -> None:
        super().__init__()
        self.group = group
        self.tp_size = tp_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``; its gradient divided by tp when a region hook all-reduces it afterwards."""
        from colossal.shardformer.layer import is_in_tp_region, scale_grad

        if is_in_tp_region(x, self.group):
            return scale_grad(x, 1.0 / self.tp_size)
        return x


def _is_lora_linear(module: nn.Module) -> bool:
    return hasattr(module, "base_layer") and isinstance(getattr(module, "lora_A", None),
                                                        nn.ModuleDict)


def _set(root: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    parent._modules[name] = module


def _unwrap(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Put each ``lora.Linear``'s base layer in its place; ``(path, lora layer)`` pairs."""
    found = [(n, m) for n, m in model.named_modules() if _is_lora_linear(m)]
    for path, lora in found:
        _set(model, path, lora.base_layer)
    return found


def _seeded(dropout: nn.Module, group: Any, replicated: bool) -> nn.Module:
    """``dropout`` seeded for tensor parallelism (collective over the group when ``p > 0``).

    One mask over the tp ranks for a replicated input, one per rank for a split input.
    """
    from colossal.shardformer.layer import DropoutForParallelInput, DropoutForReplicatedInput

    if not isinstance(dropout, nn.Dropout) or dropout.p == 0:
        return dropout
    cls = DropoutForReplicatedInput if replicated else DropoutForParallelInput
    return cls.from_native_module(dropout, group)


def _split_adapters(path: str, lora: nn.Module, base: nn.Module, group: Any) -> None:
    from colossal.shardformer.layer import Linear1D_Col, Linear1D_Row

    if base is lora.base_layer:
        return  # not sharded: the adapters stay whole
    lora_a, lora_b, dropout = lora.lora_A, lora.lora_B, lora.lora_dropout
    assert isinstance(lora_a, nn.ModuleDict) and isinstance(lora_b, nn.ModuleDict)
    assert isinstance(dropout, nn.ModuleDict)  # peft's LoraLayer keeps one entry per adapter
    names = list(lora_a)
    if type(base) is Linear1D_Col and base.n_fused == 1:
        for name in names:
            lora_b[name] = Linear1D_Col.from_native_module(
                lora_b[name], group, gather_output=base.gather_output)
            dropout[name] = nn.Sequential(
                RegionInputGrad(group, base.tp_size),
                _seeded(dropout[name], group, replicated=True))
    elif type(base) is Linear1D_Row:
        for name in names:
            lora_a[name] = Linear1D_Row.from_native_module(
                lora_a[name], group, parallel_input=base.parallel_input)
            dropout[name] = _seeded(dropout[name], group, replicated=not base.parallel_input)
    else:
        raise NotImplementedError(
            f"LoRA on {path!r}: its base layer becomes {type(base).__name__} under tensor "
            "parallelism, whose adapters cannot be split yet (plain Linear1D_Col/Linear1D_Row "
            "only); leave it out of target_modules or use tp_size=1"
        )
    lora._modules["base_layer"] = base


def lora_policy(policy: _P, group: ProcessGroup | None) -> _P:
    """A copy of ``policy`` that shards peft's LoRA layers (see the module docstring).

    Args:
        policy: The Shardformer policy of the model inside the ``PeftModel``.
        group: The tensor-parallel group.
    """
    base_cls = type(policy)

    class LoraPolicy(base_cls):  # type: ignore[valid-type, misc]
        def preprocess(self) -> nn.Module:
            self._lora_layers = _unwrap(self.model)
            return super().preprocess()

        def postprocess(self) -> nn.Module:
            model = super().postprocess()
            for path, lora in self._lora_layers:
                _split_adapters(path, lora, model.get_submodule(path), group)
                _set(model, path, lora)
            return model

    LoraPolicy.__name__ = LoraPolicy.__qualname__ = f"Lora{base_cls.__name__}"
    new = copy.copy(policy)
    new.__class__ = LoraPolicy
    return new
