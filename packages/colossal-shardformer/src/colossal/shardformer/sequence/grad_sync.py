"""Summing, over the sequence-parallel group, the gradients of parameters that see a shard.

A parameter applied to this rank's tokens only (a layer norm between the parallel linears in
``split_gather``; every parameter of the stack in ``all_to_all`` / ``ring_attn``) gets the
part of its gradient that comes from those tokens. :func:`mark_partial_grad` records such a
parameter with its group; :class:`SequenceParallelGradSync` sums the recorded gradients over
their groups, one flat all-reduce per group and dtype. Call it once after the backward
pass(es) and before the optimizer step, like the pipeline's ``SharedParamGradSync``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from colossal.core.comm import all_reduce, group_ranks

__all__ = ["SequenceParallelGradSync", "mark_partial_grad", "partial_grad_group"]

logger = logging.getLogger(__name__)

_PARTIAL_ATTR = "_colossal_sequence_partial_grad_group"
_WORLD = object()  # stands for the default group (None)


def mark_partial_grad(param: torch.Tensor, group: Any) -> None:
    """Record that ``param``'s gradient is this rank's part of a sum over ``group``.

    Args:
        param: A parameter of the model.
        group: The sequence-parallel process group (None: the whole job).

    Raises:
        TypeError: ``param`` is not a tensor.
    """
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"mark_partial_grad needs a parameter tensor, got {type(param).__name__}")
    setattr(param, _PARTIAL_ATTR, _WORLD if group is None else group)


def partial_grad_group(param: torch.Tensor) -> tuple[bool, Any]:
    """``(marked, group)``: whether :func:`mark_partial_grad` recorded ``param``, and its group."""
    tag = getattr(param, _PARTIAL_ATTR, None)
    if tag is None:
        return False, None
    return True, None if tag is _WORLD else tag


class SequenceParallelGradSync:
    """All-reduces (sums) the gradients of the parameters marked partial, per group.

    Example::

        model, _ = ShardFormer(ShardConfig(tensor_parallel_process_group=tp,
                                           enable_sequence_parallelism=True)).optimize(model)
        sync = SequenceParallelGradSync(model)
        model(**batch).loss.backward()
        sync()
        optimizer.step()

    Args:
        model: The sharded model (or any module holding marked parameters).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
    """

    def __init__(self, model: nn.Module) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"SequenceParallelGradSync needs an nn.Module, got {type(model).__name__}"
            )
        buckets: dict[tuple[tuple[int, ...], torch.dtype], tuple[Any, list[nn.Parameter]]] = {}
        for param in model.parameters():  # deduplicated: a tied parameter once
            marked, group = partial_grad_group(param)
            if not marked or not param.requires_grad:
                continue
            ranks = group_ranks(group) if dist.is_initialized() else ()
            key = (ranks, param.dtype)
            buckets.setdefault(key, (group, []))[1].append(param)
        self._buckets = list(buckets.values())

    def __len__(self) -> int:
        """Number of parameters synchronized."""
        return sum(len(params) for _, params in self._buckets)

    @property
    def parameters(self) -> list[nn.Parameter]:
        """The parameters whose gradients are summed."""
        return [p for _, params in self._buckets for p in params]

    def __call__(self) -> None:
        """Sum every marked gradient over its group (a missing gradient counts as zero)."""
        if not dist.is_initialized():
            return
        for group, params in self._buckets:
            grads = []
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
            flat = torch.cat([g.reshape(-1) for g in grads])
            all_reduce(flat, group=group)
            offset = 0
            for g in grads:
                n = g.numel()
                g.copy_(flat[offset : offset + n].view_as(g))
                offset += n
