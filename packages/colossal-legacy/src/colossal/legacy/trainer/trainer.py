"""``Trainer``: runs an Engine over data loaders for epochs, calling hooks around every step.

``Trainer(engine, timer=None, logger=None).fit(train_dataloader, epochs, ...)`` as in
ColossalAI's config-era API. A training step is::

    engine.zero_grad()
    output, label, loss = engine.execute_schedule(data_iter, forward_only=False,
                                                  return_loss=True, return_output_label=...)
    engine.step()

and a test step runs ``execute_schedule(..., forward_only=True)`` under ``torch.no_grad()``.
The schedule draws the step's batch from ``data_iter`` (one batch per step, whatever the
schedule does with it: micro-batches, pipeline stages). See
:mod:`colossal.legacy.trainer.hooks` for the order the hooks are called in.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence, Sized
from typing import Any, Protocol

import torch
from torch import nn
from torch.optim import Optimizer
from tqdm import tqdm  # type: ignore[import-untyped]  # tqdm ships no types

from colossal.core import OptimizerWrapper
from colossal.legacy.engine.schedule.base import StepResult
from colossal.legacy.trainer.hooks.base import BaseHook
from colossal.legacy.utils.common import is_dp_rank_0, is_no_pp_or_last_stage, is_tp_rank_0
from colossal.legacy.utils.timer import MultiTimer

__all__ = ["EngineLike", "Trainer"]


class EngineLike(Protocol):
    """What the Trainer needs of an Engine (``colossal.legacy.engine.Engine``)."""

    @property
    def model(self) -> nn.Module:
        """The model."""

    @property
    def optimizer(self) -> Optimizer | OptimizerWrapper:
        """The optimizer (what checkpoints save)."""

    def train(self) -> None:
        """Put the model in training mode."""

    def eval(self) -> None:
        """Put the model in evaluation mode."""

    def zero_grad(self) -> None:
        """Clear the gradients."""

    def step(self) -> object:
        """Update the parameters."""

    def execute_schedule(
        self,
        data_iter: Iterator[object],
        forward_only: bool = False,
        return_loss: bool = True,
        return_output_label: bool = True,
    ) -> StepResult:
        """Run one step on the next batch of ``data_iter``; ``(output, label, loss)``."""
        ...


def _num_samples(batch: Any) -> int:
    """Samples in a batch: the first dimension of the first tensor found in it."""
    stack = [batch]
    while stack:
        item = stack.pop(0)
        if isinstance(item, torch.Tensor):
            return int(item.shape[0]) if item.dim() > 0 else 1
        if isinstance(item, Mapping):
            stack[:0] = list(item.values())
        elif isinstance(item, list | tuple):
            stack[:0] = list(item)
    return 0


class _CountingIterator(Iterator[Any]):
    """Passes batches through and counts the samples drawn since the last ``take``."""

    def __init__(self, source: Iterator[Any]) -> None:
        self._source = source
        self._samples = 0

    def __next__(self) -> Any:
        batch = next(self._source)
        self._samples += _num_samples(batch)
        return batch

    def take(self) -> int:
        samples, self._samples = self._samples, 0
        return samples


class Trainer:
    """Trains an Engine for epochs with hooks, optionally testing it between epochs.

    Args:
        engine: The Engine from ``colossal.legacy.initialize``.
        timer: Times ``Train-step``, ``Train-epoch``, ``Test-step``, ``Test-epoch`` when given
            (steps and epochs are kept in its history).
        logger: Logs the hooks in use and the stop at ``max_steps`` (silent when None).
    """

    def __init__(
        self,
        engine: EngineLike,
        timer: MultiTimer | None = None,
        logger: logging.Logger | logging.LoggerAdapter[logging.Logger] | None = None,
    ) -> None:
        self._engine = engine
        self._timer = timer
        self._logger = logger
        self._verbose = logger is not None
        self._cur_epoch = 0
        self._cur_step = 0
        self._max_epochs = 0
        self._max_steps: int | None = None
        self._steps_per_epoch = 0
        self._last_batch_size = 0
        self.hooks: list[BaseHook] = []
        self._states: dict[str, Any] = {}

    # ---- state ---------------------------------------------------------------------------
    @property
    def engine(self) -> EngineLike:
        """The Engine being trained."""
        return self._engine

    @property
    def cur_epoch(self) -> int:
        """The epoch running now (or the next one between ``fit`` calls)."""
        return self._cur_epoch

    @cur_epoch.setter
    def cur_epoch(self, epoch: int) -> None:
        """Resume from ``epoch``: the next ``fit`` starts there."""
        self._cur_epoch = epoch

    @property
    def cur_step(self) -> int:
        """Training steps done since epoch 0."""
        return self._cur_step

    @property
    def steps_per_epoch(self) -> int:
        """Steps of one training epoch (the length of the training data loader)."""
        return self._steps_per_epoch

    @property
    def max_epochs(self) -> int:
        """The ``epochs`` of the running ``fit``."""
        return self._max_epochs

    @property
    def max_steps(self) -> int | None:
        """The ``max_steps`` of the running ``fit``."""
        return self._max_steps

    @property
    def last_batch_size(self) -> int:
        """Samples the last step drew from its data loader (this rank's)."""
        return self._last_batch_size

    @property
    def states(self) -> dict[str, Any]:
        """Shared state of the hooks: ``'metrics'`` (``{'train': {}, 'test': {}}``)...

        Any hook may keep anything under its own key (:meth:`BaseHook.init_runner_states`),
        and callers index into it (``states['metrics']['train']['Loss']``), hence ``Any``.
        """
        return self._states

    @property
    def timer(self) -> MultiTimer | None:
        """The timer given to the constructor."""
        return self._timer

    # ---- helpers -------------------------------------------------------------------------
    def _call_timer(self, action: str, item: str, *args: Any) -> None:
        if self._timer is not None:
            getattr(self._timer, action)(item, *args)

    def _call_hooks(self, func: str, output: tuple[Any, Any, Any] | None = None) -> None:
        for hook in self.hooks:
            if output is None:
                getattr(hook, func)(self)
            else:
                getattr(hook, func)(self, *output)

    @staticmethod
    def _should_display_progress(display_progress: bool) -> bool:
        return display_progress and is_dp_rank_0() and is_tp_rank_0() and is_no_pp_or_last_stage()

    def _attach(self, hooks: Sequence[BaseHook] | None) -> None:
        if hooks is None:
            hooks = []
        if isinstance(hooks, BaseHook) or not isinstance(hooks, Iterable):
            raise TypeError(f"hooks must be a list of hooks, got {type(hooks).__name__}")
        hooks = list(hooks)
        bad = [type(h).__name__ for h in hooks if not isinstance(h, BaseHook)]
        if bad:
            raise TypeError(
                f"hooks must be BaseHook instances (colossal.legacy.trainer.hooks), got {bad}"
            )
        self._states = {}
        self.hooks = sorted(hooks, key=lambda hook: hook.priority)
        if self._verbose and self._logger is not None:
            for hook in self.hooks:
                self._log(f"Using {type(hook).__name__} for training, priority = {hook.priority}")
            self._log("Lower value means higher priority for calling hook function")
        self._call_hooks("after_hook_is_attached")

    def _log(self, message: str) -> None:
        if self._logger is None:
            return
        if is_dp_rank_0() and is_tp_rank_0() and is_no_pp_or_last_stage():
            self._logger.info(message)

    def _show(self, progress: Any) -> None:
        if isinstance(progress, tqdm) and "step_metrics" in self._states:
            progress.set_postfix(**self._states["step_metrics"])

    def _exceed_max_step(self) -> bool:
        return self._max_steps is not None and self._cur_step >= self._max_steps

    @staticmethod
    def _length(loader: Iterable[object], name: str) -> int:
        if not isinstance(loader, Sized):
            raise TypeError(
                f"{name} must have a length (a DataLoader), got {type(loader).__name__}"
            )
        return len(loader)

    # ---- loops ---------------------------------------------------------------------------
    def _train_epoch(
        self, train_dataloader: Iterable[object], epoch: int, display_progress: bool,
        return_output_label: bool,
    ) -> None:  # fmt: skip
        self._engine.train()
        sampler = getattr(train_dataloader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)  # type: ignore[union-attr]
        data_iter = _CountingIterator(iter(train_dataloader))
        progress: Iterable[int] = range(self._steps_per_epoch)
        if display_progress:
            progress = tqdm(progress, desc=f"[Epoch {epoch} / Train]")
        self._call_hooks("before_train_epoch")
        self._call_timer("start", "Train-epoch")
        for _ in progress:
            self._call_hooks("before_train_iter")
            self._call_timer("start", "Train-step")
            self._engine.zero_grad()
            output, label, loss = self._engine.execute_schedule(
                data_iter,
                forward_only=False,
                return_loss=True,
                return_output_label=return_output_label,
            )
            self._engine.step()
            self._last_batch_size = data_iter.take()
            self._call_timer("stop", "Train-step", True)
            self._call_hooks("after_train_iter", output=(output, label, loss))
            self._cur_step += 1
            self._show(progress)
            if self._exceed_max_step():
                break
        self._call_timer("stop", "Train-epoch", True)
        self._call_hooks("after_train_epoch")
        self._call_timer("reset", "Train-epoch")

    def _eval(
        self, test_dataloader: Iterable[object], epoch: int | None, display_progress: bool,
        return_output_label: bool,
    ) -> None:  # fmt: skip
        self._engine.eval()
        steps = self._length(test_dataloader, "test_dataloader")
        data_iter = _CountingIterator(iter(test_dataloader))
        self._call_hooks("before_test")
        progress: Iterable[int] = range(steps)
        if display_progress:
            desc = "[Evaluate]" if epoch is None else f"[Epoch {epoch} / Test]"
            progress = tqdm(progress, desc=desc)
        self._call_hooks("before_test_epoch")
        self._call_timer("start", "Test-epoch")
        with torch.no_grad():
            for _ in progress:
                self._call_hooks("before_test_iter")
                self._call_timer("start", "Test-step")
                output, label, loss = self._engine.execute_schedule(
                    data_iter,
                    forward_only=True,
                    return_loss=True,
                    return_output_label=return_output_label,
                )
                self._last_batch_size = data_iter.take()
                self._call_timer("stop", "Test-step", True)
                self._call_hooks("after_test_iter", output=(output, label, loss))
                self._show(progress)
        self._call_timer("stop", "Test-epoch", True)
        self._call_hooks("after_test_epoch")
        self._call_hooks("after_test")
        self._call_timer("reset", "Test-step")
        self._call_timer("reset", "Test-epoch")

    # ---- public --------------------------------------------------------------------------
    def fit(
        self,
        train_dataloader: Iterable[object],
        epochs: int,
        max_steps: int | None = None,
        test_dataloader: Iterable[object] | None = None,
        test_interval: int = 1,
        hooks: Sequence[BaseHook] | None = None,
        display_progress: bool = False,
        return_output_label: bool = True,
    ) -> None:
        """Train for ``epochs`` epochs (from :attr:`cur_epoch`), testing every ``test_interval``.

        Args:
            train_dataloader: Training batches ``(data, label)``; its length is the number of
                steps per epoch.
            epochs: The epoch to stop before.
            max_steps: Stop once this many training steps were done in total.
            test_dataloader: Test batches; tested after epochs 0, ``test_interval``...
            test_interval: Epochs between tests.
            hooks: :class:`~colossal.legacy.trainer.hooks.BaseHook` instances.
            display_progress: Show a progress bar (on the rank that logs).
            return_output_label: Pass outputs and labels to the hooks (False saves memory;
                accuracy needs them).

        Raises:
            TypeError: ``hooks`` is not a list of hooks, or a data loader has no length.
            ValueError: ``epochs`` < 0, ``test_interval`` < 1 or ``max_steps`` < 1.
        """
        if epochs < 0:
            raise ValueError(f"fit: epochs={epochs} must be >= 0")
        if test_interval < 1:
            raise ValueError(f"fit: test_interval={test_interval} must be >= 1")
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"fit: max_steps={max_steps} must be >= 1 (or None)")
        self._steps_per_epoch = self._length(train_dataloader, "train_dataloader")
        self._max_steps = max_steps
        self._max_epochs = epochs
        display_progress = self._should_display_progress(display_progress)
        self._attach(hooks)
        self._engine.train()
        self._call_hooks("before_train")
        self._cur_step = self._cur_epoch * self._steps_per_epoch
        for epoch in range(self._cur_epoch, epochs):
            self._train_epoch(train_dataloader, epoch, display_progress, return_output_label)
            if test_dataloader is not None and epoch % test_interval == 0:
                self._eval(test_dataloader, epoch, display_progress, return_output_label)
            self._cur_epoch += 1
            if self._exceed_max_step():
                self._log(f"Max number of steps {max_steps} has been reached, training is stopped")
                break
        self._call_hooks("after_train")
        self._call_timer("reset", "Train-epoch")

    def evaluate(
        self,
        test_dataloader: Iterable[object],
        hooks: Sequence[BaseHook] | None = None,
        display_progress: bool = False,
        return_output_label: bool = True,
    ) -> None:
        """Run the test loop once with ``hooks`` (metrics end up in :attr:`states`).

        Args:
            test_dataloader: Test batches ``(data, label)``.
            hooks: Hooks to call.
            display_progress: Show a progress bar.
            return_output_label: Pass outputs and labels to the hooks.
        """
        display_progress = self._should_display_progress(display_progress)
        self._attach(hooks)
        self._eval(test_dataloader, None, display_progress, return_output_label)

    def predict(self, data: object) -> Any:
        """The model's output for ``data`` (a batch without labels), without gradients.

        Returns:
            Whatever the model returns (hence ``Any``).
        """
        self._engine.eval()
        with torch.no_grad():
            output, _, _ = self._engine.execute_schedule(
                iter([(data, None)]), forward_only=True, return_loss=False
            )
        return output
