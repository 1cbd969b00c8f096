"""NonPipelineSchedule: the whole model on every rank, one forward and backward per batch."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from colossal.legacy.engine.schedule.base import (
    BaseSchedule,
    StepResult,
    call_criterion,
    call_model,
)

if TYPE_CHECKING:
    from colossal.legacy.engine.engine import Engine

__all__ = ["NonPipelineSchedule"]


class NonPipelineSchedule(BaseSchedule):
    """Forward the batch, compute the loss, back-propagate it through the engine.

    The schedule of every job without pipeline parallelism (ColossalAI's default).
    """

    def forward_backward_step(
        self,
        engine: Engine,
        data_iter: Iterator[object],
        forward_only: bool = False,
        return_loss: bool = True,
        return_output_label: bool = True,
    ) -> StepResult:
        """One batch of ``data_iter`` through ``engine``.

        Args:
            engine: The engine (its model, criterion and optimizer).
            data_iter: Iterator of ``(data, label)`` batches.
            forward_only: No backward (and no autograd graph): evaluation.
            return_loss: Compute and return the loss.
            return_output_label: Return the model's output and the label.

        Returns:
            ``(output, label, loss)``; output and label are None unless
            ``return_output_label``, the loss None unless ``return_loss``.

        Raises:
            ValueError: ``return_loss=False`` without ``forward_only``.
        """
        self._check_flags(forward_only, return_loss)
        criterion = engine.criterion
        if return_loss and criterion is None:
            raise ValueError(
                "the engine has no criterion: pass criterion to initialize(...) or "
                "return_loss=False"
            )
        data, label = self.load_batch(data_iter)
        loss = None
        with torch.no_grad() if forward_only else contextlib.nullcontext():
            output = call_model(engine, data)
            if criterion is not None and return_loss:
                loss = call_criterion(criterion, output, label)
        if not forward_only:
            assert loss is not None
            engine.backward(loss)
        if return_output_label:
            return output, label, loss
        return None, None, loss
