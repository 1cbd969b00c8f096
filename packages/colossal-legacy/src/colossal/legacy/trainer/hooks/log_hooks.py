"""Hooks that log once every ``interval`` epochs: metrics, timings, memory.

They log on one rank per model replica's output: data-parallel rank 0, tensor-parallel rank
0, on the last pipeline stage (global rank 0 without tensor and pipeline parallelism). The
values are read on every rank, since reading a reduced metric is a collective.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from colossal.core import get_dist_logger
from colossal.legacy.registry import HOOKS
from colossal.legacy.trainer.hooks.base import BaseHook
from colossal.legacy.trainer.hooks.metric_hooks import format_metric
from colossal.legacy.trainer.hooks.metrics import Metric
from colossal.legacy.utils.common import is_dp_rank_0, is_no_pp_or_last_stage, is_tp_rank_0
from colossal.legacy.utils.memory import report_memory_usage
from colossal.legacy.utils.timer import MultiTimer

if TYPE_CHECKING:
    from typing import TypeAlias

    from colossal.legacy.trainer.trainer import Trainer

    Logger: TypeAlias = logging.Logger | logging.LoggerAdapter[logging.Logger]

__all__ = [
    "LogByEpochHook",
    "LogMemoryByEpochHook",
    "LogMetricByEpochHook",
    "LogTimingByEpochHook",
    "metric_values",
]


def metric_values(
    trainer: Trainer, mode: str, names: Sequence[str] | None = None
) -> dict[str, float]:
    """The values of ``trainer.states['metrics'][mode]`` to log (collective, see module doc).

    Epoch-only metrics give their accumulated value, the others their last step's.

    Args:
        trainer: The Trainer.
        mode: ``"train"`` or ``"test"``.
        names: Only these metrics (all when None).
    """
    metrics: dict[str, Metric] = trainer.states.get("metrics", {}).get(mode, {})
    return {
        name: metric.get_accumulated_value() if metric.epoch_only else metric.get_last_step_value()
        for name, metric in metrics.items()
        if names is None or name in names
    }


class LogByEpochHook(BaseHook):
    """Base of the hooks that log every ``interval`` epochs.

    Args:
        logger: Where to log (:func:`~colossal.core.get_dist_logger`'s when None).
        interval: Log after epochs 0, interval, 2 * interval...
        priority: Lower values run earlier.

    Raises:
        ValueError: ``interval`` < 1.
    """

    def __init__(self, logger: Logger | None, interval: int = 1, priority: int = 1) -> None:
        super().__init__(priority)
        if interval < 1:
            raise ValueError(f"{type(self).__name__}: interval={interval} must be >= 1")
        self.logger: Logger = logger if logger is not None else get_dist_logger()
        self._interval = interval

    def _is_epoch_to_log(self, trainer: Trainer) -> bool:
        return trainer.cur_epoch % self._interval == 0

    @staticmethod
    def _is_rank_to_log() -> bool:
        return is_dp_rank_0() and is_tp_rank_0() and is_no_pp_or_last_stage()

    def _log(self, message: str) -> None:
        if self._is_rank_to_log():
            self.logger.info(message)


@HOOKS.register_module
class LogMetricByEpochHook(LogByEpochHook):
    """Logs the metrics after every ``interval``-th training epoch and its test.

    Args:
        logger: Where to log.
        interval: Epochs between logs.
        priority: Lower values run earlier.
    """

    def __init__(self, logger: Logger | None = None, interval: int = 1, priority: int = 10) -> None:
        super().__init__(logger, interval, priority)

    def _message(self, trainer: Trainer, mode: str) -> str | None:
        values = metric_values(trainer, mode)
        if not values:
            return None
        text = ", ".join(f"{name} = {format_metric(value)}" for name, value in values.items())
        return f"[Epoch {trainer.cur_epoch} / {mode.capitalize()}]: {text}"

    def after_train_epoch(self, trainer: Trainer) -> None:
        """Log the training metrics."""
        if self._is_epoch_to_log(trainer):
            message = self._message(trainer, "train")
            if message is not None:
                self._log(message)

    def after_test_epoch(self, trainer: Trainer) -> None:
        """Log the test metrics."""
        if self._is_epoch_to_log(trainer):
            message = self._message(trainer, "test")
            if message is not None:
                self._log(message)


@HOOKS.register_module
class LogTimingByEpochHook(LogByEpochHook):
    """Logs the Trainer's timers (``Train-step``, ``Train-epoch``, ``Test-*``) by epoch.

    For each timer of the mode: the last interval, the mean and the count of the kept
    intervals. The step timers are reset after each log, so every log covers its epochs.

    Args:
        timer: The Trainer's :class:`~colossal.legacy.utils.MultiTimer`.
        logger: Where to log.
        interval: Epochs between logs.
        priority: Lower values run earlier.
        log_eval: Also log the test timers.
        ignore_num_train_steps: Leave the first steps of each logged span out of the
            ``Train-step`` mean (warm-up).
    """

    def __init__(
        self,
        timer: MultiTimer,
        logger: Logger | None = None,
        interval: int = 1,
        priority: int = 10,
        log_eval: bool = True,
        ignore_num_train_steps: int = 0,
    ) -> None:
        super().__init__(logger, interval, priority)
        self._timer = timer
        self._log_eval = log_eval
        self._ignore = ignore_num_train_steps

    def _message(self, trainer: Trainer, mode: str) -> str:
        parts = []
        for name, timer in self._timer:
            if not name.startswith(mode) or not timer.has_history:
                continue
            history = timer.get_history()
            if name == f"{mode}-step" and len(history) > self._ignore:
                history = history[self._ignore :]
            mean = sum(history) / len(history)
            parts.append(
                f"{name}: last = {format_metric(history[-1])} s, "
                f"mean = {format_metric(mean)} s over {len(history)}"
            )
        return f"[Epoch {trainer.cur_epoch} / {mode}] " + ", ".join(parts)

    def after_train_epoch(self, trainer: Trainer) -> None:
        """Log the training timers."""
        if self._is_epoch_to_log(trainer):
            self._log(self._message(trainer, "Train"))
            self._timer.reset("Train-step")

    def after_test(self, trainer: Trainer) -> None:
        """Log the test timers."""
        if self._log_eval and self._is_epoch_to_log(trainer):
            self._log(self._message(trainer, "Test"))
            self._timer.reset("Test-step")


@HOOKS.register_module
class LogMemoryByEpochHook(LogByEpochHook):
    """Logs memory before training and after every ``interval``-th epoch (and test).

    On CUDA the accelerator's tensor memory, on CPU the process's resident set size, with
    the peak since the previous report.

    Args:
        logger: Where to log.
        interval: Epochs between logs.
        priority: Lower values run earlier.
        log_eval: Also log after testing.
        report_cpu: Accepted for ColossalAI's signature (the CPU is what is reported on CPU).
    """

    def __init__(
        self,
        logger: Logger | None = None,
        interval: int = 1,
        priority: int = 10,
        log_eval: bool = True,
        report_cpu: bool = False,
    ) -> None:
        super().__init__(logger, interval, priority)
        self._log_eval = log_eval

    def before_train(self, trainer: Trainer) -> None:
        """Log memory before training."""
        self._log(report_memory_usage("Before-train"))

    def after_train_epoch(self, trainer: Trainer) -> None:
        """Log memory after the epoch."""
        if self._is_epoch_to_log(trainer):
            self._log(report_memory_usage(f"[Epoch {trainer.cur_epoch} / Train]"))

    def after_test(self, trainer: Trainer) -> None:
        """Log memory after testing."""
        if self._log_eval and self._is_epoch_to_log(trainer):
            self._log(report_memory_usage(f"[Epoch {trainer.cur_epoch} / Test]"))
