"""Hooks that keep metrics in ``trainer.states['metrics']``: loss, accuracy, lr, throughput.

``trainer.states['metrics']`` is ``{'train': {name: Metric}, 'test': {name: Metric}}``; the
logging hooks read it. Metrics are computed where the losses are: on every rank without a
pipeline, on the last stage with one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from colossal.core import get_accelerator
from colossal.legacy.registry import HOOKS
from colossal.legacy.trainer.hooks.base import BaseHook
from colossal.legacy.trainer.hooks.metrics import (
    AccuracyMetric,
    LearningRateMetric,
    Logits,
    LossMetric,
    Metric,
    ThroughputMetric,
)
from colossal.legacy.utils.checkpointing import SchedulerLike
from colossal.legacy.utils.common import is_no_pp_or_last_stage

if TYPE_CHECKING:
    from colossal.legacy.trainer.trainer import Trainer

__all__ = [
    "AccuracyHook",
    "LRSchedulerHook",
    "LogMetricByStepHook",
    "LossHook",
    "MetricHook",
    "ThroughputHook",
    "format_metric",
]


def format_metric(value: float) -> str:
    """A metric value for logs and the progress bar (5 significant digits)."""
    return f"{value:.5g}"


class MetricHook(BaseHook):
    """Base of the hooks that add metrics: makes sure ``trainer.states['metrics']`` exists.

    Args:
        priority: Lower values run earlier.
    """

    def __init__(self, priority: int) -> None:
        super().__init__(priority)
        self._is_stage_to_compute = True

    def _check_metric_states_initialization(self, trainer: Trainer) -> None:
        self._is_stage_to_compute = is_no_pp_or_last_stage()
        self.init_runner_states(trainer, "metrics", {"train": {}, "test": {}})

    def _add(self, trainer: Trainer, mode: str, name: str, metric: Metric) -> None:
        trainer.states["metrics"][mode][name] = metric


@HOOKS.register_module
class LossHook(MetricHook):
    """Keeps the training loss (``'Loss'``, per step) and the test loss (per epoch).

    Args:
        priority: Lower values run earlier.
    """

    def __init__(self, priority: int = 0) -> None:
        super().__init__(priority)
        self.train_loss: LossMetric | None = None
        self.test_loss: LossMetric | None = None

    def after_hook_is_attached(self, trainer: Trainer) -> None:
        """Register the two loss metrics."""
        self._check_metric_states_initialization(trainer)
        if self._is_stage_to_compute:
            self.train_loss = LossMetric(epoch_only=False)
            self.test_loss = LossMetric(epoch_only=True)
            self._add(trainer, "train", "Loss", self.train_loss)
            self._add(trainer, "test", "Loss", self.test_loss)

    def before_train_epoch(self, trainer: Trainer) -> None:
        """Start the epoch's training loss."""
        if self.train_loss is not None:
            self.train_loss.reset()

    def after_train_iter(
        self, trainer: Trainer, output: object, label: object, loss: torch.Tensor | None
    ) -> None:
        """Add the step's loss."""
        if self.train_loss is not None and loss is not None:
            self.train_loss.update(loss)

    def before_test_epoch(self, trainer: Trainer) -> None:
        """Start the test loss."""
        if self.test_loss is not None:
            self.test_loss.reset()

    def after_test_iter(
        self, trainer: Trainer, output: object, label: object, loss: torch.Tensor | None
    ) -> None:
        """Add the test step's loss."""
        if self.test_loss is not None and loss is not None:
            self.test_loss.update(loss)


@HOOKS.register_module
class AccuracyHook(MetricHook):
    """Keeps the test accuracy (``'Accuracy'``), over the data-parallel group.

    Args:
        accuracy_func: ``(logits, targets) -> number of correct predictions``, e.g.
            :class:`colossal.legacy.nn.metric.Accuracy`.
        priority: Lower values run earlier.
    """

    def __init__(
        self, accuracy_func: Callable[[torch.Tensor, Any], torch.Tensor | int], priority: int = 0
    ) -> None:
        super().__init__(priority)
        self.accuracy_func = accuracy_func
        self.metric: AccuracyMetric | None = None

    def after_hook_is_attached(self, trainer: Trainer) -> None:
        """Register the accuracy metric."""
        self._check_metric_states_initialization(trainer)
        if self._is_stage_to_compute:
            self.metric = AccuracyMetric(epoch_only=True, accuracy_func=self.accuracy_func)
            self._add(trainer, "test", "Accuracy", self.metric)

    def before_test(self, trainer: Trainer) -> None:
        """Start counting."""
        if self.metric is not None:
            self.metric.reset()

    def after_test_iter(
        self,
        trainer: Trainer,
        output: Logits | None,
        label: object,
        loss: torch.Tensor | None,
    ) -> None:
        """Count the step's correct predictions.

        Raises:
            ValueError: No output or label (``return_output_label=False``).
        """
        if self.metric is None:
            return
        if output is None or label is None:
            raise ValueError(
                "AccuracyHook needs the model's output and the labels; run the Trainer with "
                "return_output_label=True"
            )
        self.metric.update(output, label)


@HOOKS.register_module
class LRSchedulerHook(MetricHook):
    """Steps ``lr_scheduler`` after every epoch (``by_epoch``) or every training step.

    Args:
        lr_scheduler: The scheduler (the one ``initialize`` returned under gradient
            accumulation steps with the optimizer only).
        by_epoch: Step it once per epoch (else once per step).
        store_lr_in_state: Keep the rate as the ``'LR'`` training metric.
        priority: Lower values run earlier.
    """

    def __init__(
        self,
        lr_scheduler: SchedulerLike,
        by_epoch: bool,
        store_lr_in_state: bool = True,
        priority: int = 1,
    ) -> None:
        super().__init__(priority)
        self.lr_scheduler = lr_scheduler
        self.by_epoch = by_epoch
        self.store_lr_in_state = store_lr_in_state
        self.metric: LearningRateMetric | None = None

    def _lr(self) -> float:
        return float(self.lr_scheduler.get_last_lr()[0])

    def after_hook_is_attached(self, trainer: Trainer) -> None:
        """Register the ``'LR'`` metric."""
        self._check_metric_states_initialization(trainer)
        if self.store_lr_in_state:
            self.metric = LearningRateMetric(epoch_only=self.by_epoch, initial_lr=self._lr())
            self._add(trainer, "train", "LR", self.metric)

    def _step(self) -> None:
        self.lr_scheduler.step()
        if self.metric is not None:
            self.metric.update(self._lr())

    def after_train_epoch(self, trainer: Trainer) -> None:
        """Step the scheduler (``by_epoch``)."""
        if self.by_epoch:
            self._step()

    def after_train_iter(
        self, trainer: Trainer, output: object, label: object, loss: torch.Tensor | None
    ) -> None:
        """Step the scheduler (not ``by_epoch``)."""
        if not self.by_epoch:
            self._step()


@HOOKS.register_module
class ThroughputHook(MetricHook):
    """Samples per second of training (``'Throughput'``, per step) and testing (per epoch).

    A step's samples are those the Trainer drew from the data loader for it
    (``trainer.last_batch_size``); its time is measured by the hook.

    Args:
        ignored_steps: Steps at the start of each epoch left out (warm-up).
        priority: Lower values run earlier.
        tflop_per_step: TFLOP of one step on one rank, for TFLOPS (0: unknown).
        use_local: This rank's throughput instead of the data-parallel group's.
    """

    def __init__(
        self,
        ignored_steps: int = 0,
        priority: int = 10,
        tflop_per_step: float = 0.0,
        use_local: bool = False,
    ) -> None:
        super().__init__(priority)
        self.ignored_steps = ignored_steps
        self.tflop_per_step = tflop_per_step
        self.use_local = use_local
        self.train_metric: ThroughputMetric | None = None
        self.test_metric: ThroughputMetric | None = None
        self._start = 0.0

    def after_hook_is_attached(self, trainer: Trainer) -> None:
        """Register the throughput metrics."""
        self._check_metric_states_initialization(trainer)
        if self._is_stage_to_compute:
            self.train_metric, self.test_metric = self._metric(False), self._metric(True)
            self._add(trainer, "train", "Throughput", self.train_metric)
            self._add(trainer, "test", "Throughput", self.test_metric)

    def _metric(self, epoch_only: bool) -> ThroughputMetric:
        return ThroughputMetric(epoch_only, self.ignored_steps, self.tflop_per_step, self.use_local)

    def _begin(self) -> None:
        get_accelerator().synchronize()
        self._start = time.perf_counter()

    def _end(self, trainer: Trainer, metric: ThroughputMetric | None) -> None:
        if metric is None:
            return
        get_accelerator().synchronize()
        metric.update(trainer.last_batch_size, time.perf_counter() - self._start)

    def before_train_epoch(self, trainer: Trainer) -> None:
        """Start the epoch's counts."""
        if self.train_metric is not None:
            self.train_metric.reset()

    def before_train_iter(self, trainer: Trainer) -> None:
        """Start the step's clock."""
        self._begin()

    def after_train_iter(
        self, trainer: Trainer, output: object, label: object, loss: torch.Tensor | None
    ) -> None:
        """Count the step."""
        self._end(trainer, self.train_metric)

    def before_test(self, trainer: Trainer) -> None:
        """Start the test counts."""
        if self.test_metric is not None:
            self.test_metric.reset()

    def before_test_iter(self, trainer: Trainer) -> None:
        """Start the test step's clock."""
        self._begin()

    def after_test_iter(
        self, trainer: Trainer, output: object, label: object, loss: torch.Tensor | None
    ) -> None:
        """Count the test step."""
        self._end(trainer, self.test_metric)


@HOOKS.register_module
class LogMetricByStepHook(MetricHook):
    """Puts each step's metric values into ``trainer.states['step_metrics']``.

    The Trainer shows them next to its progress bar.

    Args:
        priority: Lower values run earlier.
    """

    def __init__(self, priority: int = 10) -> None:
        super().__init__(priority)

    def after_hook_is_attached(self, trainer: Trainer) -> None:
        """Make sure the metrics exist."""
        self._check_metric_states_initialization(trainer)

    def _record(self, trainer: Trainer, mode: str) -> None:
        metrics: dict[str, Metric] = trainer.states["metrics"][mode]
        trainer.states["step_metrics"] = {
            name.lower(): format_metric(metric.get_last_step_value())
            for name, metric in metrics.items()
        }

    def after_train_iter(
        self, trainer: Trainer, output: object, label: object, loss: torch.Tensor | None
    ) -> None:
        """The training metrics of this step."""
        self._record(trainer, "train")

    def after_test_iter(
        self, trainer: Trainer, output: object, label: object, loss: torch.Tensor | None
    ) -> None:
        """The test metrics of this step."""
        self._record(trainer, "test")
