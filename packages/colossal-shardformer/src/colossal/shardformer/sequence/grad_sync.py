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
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.utils.hooks import RemovableHandle

from colossal.core.comm import all_reduce, group_ranks

__all__ = [
    "SequenceParallelGradSync",
    "mark_partial_grad",
    "partial_grad_group",
    "register_partial_grad_hooks",
]

logger = logging.getLogger(__name__)

_PARTIAL_ATTR = "_colossal_sequence_partial_grad_group"
_WORLD = object()  # stands for the default group (None)


def mark_partial_grad(param: torch.Tensor, group: ProcessGroup | None) -> None:
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


def partial_grad_group(param: torch.Tensor) -> tuple[bool, ProcessGroup | None]:
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


def _summed_over(group: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    def hook(grad: torch.Tensor) -> torch.Tensor:
        total = grad.contiguous().clone()
        all_reduce(total, group=group)
        return total

    return hook


def _scaled_by(factor: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def hook(grad: torch.Tensor) -> torch.Tensor:
        return grad * factor

    return hook


def register_partial_grad_hooks(
    model: nn.Module, averaged: Callable[[tuple[int, ...]], bool] | None = None
) -> list[RemovableHandle]:
    """Make each marked parameter's gradient whole as autograd produces it.

    For optimizers that take gradients during the backward (ZeRO's buckets), where
    :class:`SequenceParallelGradSync` after the backward comes too late. The hook runs on
    the gradient of this backward before it is accumulated, so gradients accumulated over
    several backwards are not summed twice. A parameter's gradient is summed over its group
    (every rank of a group runs the same graph, so the hooks' all-reduces come in the same
    order on all of them), unless the caller's own reduction averages over a group holding
    it (ZeRO over ``dp x sp``): then it is multiplied by the group's size, and the average of
    the scaled parts is their sum, with no communication of its own.

    Args:
        model: The sharded model (or any module holding marked parameters).
        averaged: Given a group's ranks, whether the caller's reduction averages over them.

    Returns:
        The hooks' handles (``handle.remove()`` undoes them).
    """
    handles = []
    for param in model.parameters():  # deduplicated: a tied parameter once
        marked, group = partial_grad_group(param)
        if not marked or not param.requires_grad or not dist.is_initialized():
            continue
        ranks = tuple(group_ranks(group))
        if len(ranks) == 1:
            continue
        if averaged is not None and averaged(ranks):
            handles.append(param.register_hook(_scaled_by(len(ranks))))
        else:
            handles.append(param.register_hook(_summed_over(group)))
    return handles
