"""Gradient averaging over a data-parallel mode: DATA, or SEQUENCE_DP under sequence mode."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from colossal.core import get_accelerator
from colossal.core.comm import all_reduce
from colossal.legacy.context.parallel_context import global_context as gpc
from colossal.legacy.context.parallel_mode import ParallelMode
from colossal.legacy.engine.gradient_handler.base import BaseGradientHandler
from colossal.legacy.registry import GRADIENT_HANDLER

__all__ = [
    "DataParallelGradientHandler",
    "SequenceParallelGradientHandler",
    "average_gradients",
]

#: Elements per all-reduce bucket (per dtype).
BUCKET_ELEMENTS = 2**24


def _agree_on_grads(params: list[torch.Tensor], group: dist.ProcessGroup) -> list[bool]:
    """Which parameters have a gradient on *some* rank of ``group`` (one small all-reduce).

    A parameter unused on one rank but used on another must still be averaged on both, so
    every rank sends the same buckets.
    """
    device = get_accelerator().get_current_device()  # nccl reduces device tensors only
    present = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=device)
    all_reduce(present, op=dist.ReduceOp.MAX, group=group)
    return [bool(x) for x in present.tolist()]


def average_gradients(
    params: Iterable[torch.Tensor],
    group: dist.ProcessGroup,
    bucket_elements: int = BUCKET_ELEMENTS,
) -> int:
    """Average the gradients of ``params`` over ``group``, flattened into per-dtype buckets.

    Every rank of ``group`` must call it with the same parameters (in the same order). A
    parameter that has a gradient on some rank but not on this one gets a zero gradient
    here, so the averages agree on every rank.

    Returns:
        How many all-reduces of gradients were issued (0 for a group of one rank).
    """
    size = dist.get_world_size(group)
    trainable = [p for p in params if p.requires_grad]
    if size < 2 or not trainable:
        return 0
    with torch.no_grad():
        for param, present in zip(trainable, _agree_on_grads(trainable, group), strict=True):
            if present and param.grad is None:
                param.grad = torch.zeros_like(param)
        buckets: dict[tuple[torch.dtype, torch.device], list[list[torch.Tensor]]] = {}
        for param in trainable:
            grad = param.grad
            if grad is None:
                continue
            lists = buckets.setdefault((grad.dtype, grad.device), [[]])
            if lists[-1] and sum(g.numel() for g in lists[-1]) + grad.numel() > bucket_elements:
                lists.append([])
            lists[-1].append(grad)
        calls = 0
        for key in sorted(buckets, key=str):  # the same order on every rank
            for grads in buckets[key]:
                flat = _flatten_dense_tensors(grads)
                all_reduce(flat, group=group)
                flat.div_(size)
                for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
                    grad.copy_(synced)
                calls += 1
    return calls


class _ModeAverage(BaseGradientHandler):
    mode = ParallelMode.DATA

    def __init__(self, model: nn.Module, optimizer: Any) -> None:
        super().__init__(model, optimizer)
        self._group = gpc.get_group(self.mode) if gpc.is_initialized(self.mode) else None

    def handle_gradient(self) -> None:
        """Average the model's gradients over the mode's ranks (nothing with one rank)."""
        if self._group is not None:
            average_gradients(self._model.parameters(), self._group)


@GRADIENT_HANDLER.register_module
class DataParallelGradientHandler(_ModeAverage):
    """Averages gradients over ``ParallelMode.DATA`` (instead of torch DDP).

    Gradients are flattened into buckets (one per dtype, at most ``BUCKET_ELEMENTS`` each)
    and all-reduced, then divided by the data-parallel size. ``initialize`` adds it when
    data parallelism meets pipeline or tensor parallelism or naive AMP, or when the config
    names it.
    """

    mode = ParallelMode.DATA


@GRADIENT_HANDLER.register_module
class SequenceParallelGradientHandler(_ModeAverage):
    """Averages gradients over ``ParallelMode.SEQUENCE_DP`` (sequence mode: data x sequence).

    Under ``tensor=dict(mode='sequence')`` every rank of the data x sequence group holds the
    whole model; their gradients are averaged as data parallelism's would be.
    """

    mode = ParallelMode.SEQUENCE_DP
