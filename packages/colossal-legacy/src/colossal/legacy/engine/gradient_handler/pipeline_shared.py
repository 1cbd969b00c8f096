"""PipelineSharedModuleGradientHandler: sums the gradients of parameters tied across stages."""

from __future__ import annotations

import torch
import torch.distributed as dist

from colossal.core.comm import all_reduce
from colossal.legacy.engine.gradient_handler.base import BaseGradientHandler
from colossal.legacy.pipeline.shared import shared_parameters
from colossal.legacy.registry import GRADIENT_HANDLER

__all__ = ["PipelineSharedModuleGradientHandler"]


@GRADIENT_HANDLER.register_module
class PipelineSharedModuleGradientHandler(BaseGradientHandler):
    """Sums each tied parameter's gradient over the stages holding a copy.

    Parameters registered with :class:`~colossal.legacy.pipeline.PipelineSharedModuleWrapper`
    (e.g. the word embedding of the first stage and the output head of the last) carry the
    group of their copies; each copy receives the sum of all copies' gradients, so the
    copies stay equal after the step. ``initialize`` adds this handler when the model has
    such parameters. A copy without a gradient contributes zeros.
    """

    def handle_gradient(self) -> None:
        """All-reduce (sum) the tied parameters' gradients, one flat bucket per group."""
        by_group: dict[int, tuple[dist.ProcessGroup, list[torch.Tensor]]] = {}
        for param, group in shared_parameters(self._model):
            by_group.setdefault(id(group), (group, []))[1].append(param)
        with torch.no_grad():
            for group, params in by_group.values():  # registration order: the same on peers
                grads = []
                for param in params:
                    if param.grad is None:
                        param.grad = torch.zeros_like(param)
                    grads.append(param.grad)
                flat = torch.cat([g.reshape(-1).float() for g in grads])
                all_reduce(flat, group=group)
                offset = 0
                for grad in grads:
                    n = grad.numel()
                    grad.copy_(flat[offset : offset + n].view_as(grad))
                    offset += n
