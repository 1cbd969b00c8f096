"""Engine: the model, optimizer and criterion of a config-era job behind one object.

``initialize`` returns it equipped with what the config asked for (DDP or ZeRO or gradient
handlers, mixed precision, gradient accumulation, clipping, a pipeline schedule); the user's
loop is PyTorch's with ``engine`` in place of the three pieces::

    for img, label in train_dataloader:
        engine.zero_grad()
        output = engine(img)
        loss = engine.criterion(output, label)
        engine.backward(loss)
        engine.step()
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from colossal.core import OptimizerWrapper
from colossal.legacy.engine.gradient_handler.base import BaseGradientHandler
from colossal.legacy.engine.schedule.base import BaseSchedule, StepResult
from colossal.legacy.engine.schedule.non_pipeline import NonPipelineSchedule
from colossal.legacy.engine.schedule.pipeline import PipelineSchedule

__all__ = ["Engine"]

logger = logging.getLogger(__name__)


class Engine:
    """Wraps model, optimizer and criterion with the features ``initialize`` set up.

    Args:
        model: The (possibly wrapped: DDP, AMP) model.
        optimizer: The optimizer; a torch optimizer is wrapped in
            :class:`colossal.core.OptimizerWrapper`.
        criterion: The loss function (``criterion(output, label)``), or None.
        gradient_handlers: Called in :meth:`step` before clipping and the optimizer step.
        clip_grad_norm: Clip the global gradient norm to this in :meth:`step` (0: off); the
            norm is :func:`colossal.core.grad_norm` over the job, correct under tensor and
            pipeline parallelism and ZeRO, taken after unscaling under fp16.
        ophook_list: ColossalAI's operator hooks (ZeRO-3 memory tracing there): stored and
            exposed as :attr:`ophooks`, not called.
        verbose: Log what the engine was built with (rank 0).
        schedule: How :meth:`execute_schedule` runs a batch
            (:class:`~colossal.legacy.engine.schedule.NonPipelineSchedule` when None).

    Raises:
        ValueError: ``clip_grad_norm`` is negative.
        TypeError: A gradient handler without ``handle_gradient``, or a schedule that is not
            a :class:`BaseSchedule`.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: OptimizerWrapper | Optimizer,
        criterion: Callable[..., torch.Tensor] | None = None,
        gradient_handlers: Sequence[BaseGradientHandler] | None = None,
        clip_grad_norm: float = 0.0,
        ophook_list: Iterable[object] | None = None,
        verbose: bool = True,
        schedule: BaseSchedule | None = None,
    ) -> None:
        if not clip_grad_norm >= 0:
            raise ValueError(f"clip_grad_norm={clip_grad_norm!r} must be >= 0 (0 disables it)")
        handlers = list(gradient_handlers or [])
        for handler in handlers:
            if not callable(getattr(handler, "handle_gradient", None)):
                raise TypeError(
                    f"gradient handler {handler!r} has no handle_gradient(); subclass "
                    "BaseGradientHandler"
                )
        if schedule is not None and not isinstance(schedule, BaseSchedule):
            raise TypeError(f"schedule must be a BaseSchedule, got {type(schedule).__name__}")
        self._model = model
        self._optimizer = (
            optimizer if isinstance(optimizer, OptimizerWrapper) else OptimizerWrapper(optimizer)
        )
        self._criterion = criterion
        self._gradient_handlers = handlers
        self._clip_grad_norm = float(clip_grad_norm)
        self._ophook_list = list(ophook_list or [])
        self._verbose = verbose
        self._schedule = schedule if schedule is not None else NonPipelineSchedule()
        self._schedule.pre_processing(self)
        if verbose:
            logger.info(
                "engine: %s, %s, handlers %s, clip_grad_norm=%g, schedule %s",
                type(model).__name__,
                type(self._optimizer).__name__,
                [type(h).__name__ for h in handlers],
                self._clip_grad_norm,
                type(self._schedule).__name__,
            )

    # ---- the pieces ----------------------------------------------------------------------------
    @property
    def model(self) -> nn.Module:
        """The model (as wrapped by ``initialize``)."""
        return self._model

    @property
    def optimizer(self) -> OptimizerWrapper:
        """The optimizer wrapper."""
        return self._optimizer

    @property
    def criterion(self) -> Callable[..., torch.Tensor] | None:
        """The loss function: ``engine.criterion(output, label)``."""
        return self._criterion

    @property
    def schedule(self) -> BaseSchedule:
        """The schedule :meth:`execute_schedule` runs."""
        return self._schedule

    @property
    def uses_pipeline(self) -> bool:
        """Whether the schedule is a pipeline schedule."""
        return isinstance(self._schedule, PipelineSchedule)

    @property
    def gradient_handlers(self) -> list[BaseGradientHandler]:
        """The gradient handlers :meth:`step` calls."""
        return list(self._gradient_handlers)

    @property
    def clip_grad_norm(self) -> float:
        """The clipping norm (0: off)."""
        return self._clip_grad_norm

    @property
    def ophooks(self) -> list[object]:
        """The operator hooks given to the engine (stored, not called)."""
        return list(self._ophook_list)

    # ---- the loop ------------------------------------------------------------------------------
    def train(self) -> None:
        """Put the model in training mode."""
        self._model.train()

    def eval(self) -> None:
        """Put the model in evaluation mode."""
        self._model.eval()

    def zero_grad(self) -> None:
        """Clear the gradients (through the optimizer)."""
        self._optimizer.zero_grad()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward (its output, whatever the model returns)."""
        return self._model(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate ``loss`` through the optimizer (loss scaling, accumulation, ZeRO)."""
        self._optimizer.backward(loss)

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        """Back-propagate ``grad`` from ``tensor`` (pipeline stages)."""
        self._optimizer.backward_by_grad(tensor, grad)

    def _all_reduce_gradients(self) -> None:
        for handler in self._gradient_handlers:
            handler.handle_gradient()

    def step(self) -> float | None:
        """Synchronize gradients (handlers), clip them, and step the optimizer.

        Returns:
            What the optimizer's step returns (None for a skipped or accumulating step).
        """
        self._all_reduce_gradients()
        if self._clip_grad_norm > 0:
            self._optimizer.clip_grad_by_norm(self._clip_grad_norm)
        return self._optimizer.step()

    def execute_schedule(
        self,
        data_iter: Iterator[object],
        forward_only: bool = False,
        return_loss: bool = True,
        return_output_label: bool = True,
    ) -> StepResult:
        """Run one batch of ``data_iter`` through the schedule.

        Args:
            data_iter: Iterator of ``(data, label)`` batches (e.g. ``iter(dataloader)``).
            forward_only: Evaluate: no backward.
            return_loss: Compute the loss.
            return_output_label: Return the output and the label.

        Returns:
            ``(output, label, loss)`` (None where not asked for; on pipeline stages other
            than the last, all three are None).
        """
        return self._schedule.forward_backward_step(
            self, data_iter, forward_only, return_loss, return_output_label
        )

    def __repr__(self) -> str:
        return (
            f"Engine(model={type(self._model).__name__}, optimizer="
            f"{type(self._optimizer).__name__}, schedule={type(self._schedule).__name__})"
        )
