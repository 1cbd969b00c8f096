"""Metrics the metric hooks keep in ``trainer.states['metrics']``.

Accumulated values are summed over the ranks that share a model replica's data (``gpc``'s
DATA group; SEQUENCE_DP under sequence parallelism, whose ranks each see part of every
sample) before they are divided, so they equal one process that saw every rank's samples.
Reading a reduced value is a collective: every rank of the group reads it (the hooks do).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from colossal.legacy.context import ParallelMode
from colossal.legacy.core import gpc
from colossal.legacy.utils.common import get_current_device

__all__ = [
    "AccuracyMetric",
    "LearningRateMetric",
    "Logits",
    "LossMetric",
    "Metric",
    "ThroughputMetric",
    "dp_sum",
    "metric_mode",
]

#: The model's output as the accuracy reads it: the logits, or a tuple/list of tensors whose
#: first item they are.
Logits = torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...]


def metric_mode() -> ParallelMode:
    """The group metrics are reduced over: SEQUENCE_DP under sequence parallelism, else DATA."""
    if gpc.is_initialized(ParallelMode.SEQUENCE_DP):
        return ParallelMode.SEQUENCE_DP
    return ParallelMode.DATA


def _size(mode: ParallelMode) -> int:
    return gpc.get_world_size(mode) if gpc.is_initialized(mode) else 1


def dp_sum(values: torch.Tensor, mode: ParallelMode | None = None) -> torch.Tensor:
    """``values`` summed over ``mode``'s group (:func:`metric_mode`'s by default).

    Returns a copy; without such a group (or with one rank in it) the values themselves.
    """
    mode = metric_mode() if mode is None else mode
    out = values.detach().clone()
    if _size(mode) > 1:
        dist.all_reduce(out, group=gpc.get_group(mode))
    return out


def _ratio(numerator: torch.Tensor | float, denominator: torch.Tensor | float) -> float:
    den = float(denominator)
    return float(numerator) / den if den != 0 else math.nan


class Metric(ABC):
    """A value the Trainer's hooks update each step and log.

    Args:
        epoch_only: Only the value over the epoch is meaningful (loggers read
            :meth:`get_accumulated_value`; otherwise :meth:`get_last_step_value`).
    """

    def __init__(self, epoch_only: bool) -> None:
        self._epoch_only = epoch_only

    @property
    def epoch_only(self) -> bool:
        """Whether only the accumulated value is logged."""
        return self._epoch_only

    @abstractmethod
    def reset(self) -> None:
        """Forget everything accumulated."""

    @abstractmethod
    def update(self, *args: Any, **kwargs: Any) -> None:
        """Add a step's data."""

    @abstractmethod
    def get_last_step_value(self) -> float:
        """The value of the last step."""

    @abstractmethod
    def get_accumulated_value(self) -> float:
        """The value over every step since :meth:`reset` (over the data-parallel group)."""

    @staticmethod
    @abstractmethod
    def is_better(a: float, b: float) -> bool:
        """Whether value ``a`` is better than ``b``."""


class LossMetric(Metric):
    """The mean loss: the last step's on this rank, the epoch's over the data-parallel group.

    The accumulated value is the mean of every step loss of every data-parallel rank (equal
    to one process's mean over the same samples when the ranks' batches are equal).
    """

    def __init__(self, epoch_only: bool) -> None:
        super().__init__(epoch_only)
        self._device = get_current_device()
        self.reset()

    def reset(self) -> None:
        """Forget the losses."""
        self._last_step: torch.Tensor | None = None
        self._sums = torch.zeros(2, dtype=torch.float64, device=self._device)  # sum, count

    def update(self, loss: torch.Tensor | float) -> None:
        """Add a step's loss (a scalar tensor or a number; a tensor is averaged)."""
        value = loss.detach().float().mean() if isinstance(loss, torch.Tensor) else loss
        step = torch.as_tensor(value, dtype=torch.float64).to(self._device)
        self._sums[0] += step
        self._sums[1] += 1
        self._last_step = step

    def get_last_step_value(self) -> float:
        """This rank's last loss (no communication)."""
        return float(self._last_step) if self._last_step is not None else math.nan

    def get_accumulated_value(self) -> float:
        """Mean loss over the group's steps since :meth:`reset` (collective)."""
        sums = dp_sum(self._sums)
        return _ratio(sums[0], sums[1])

    @staticmethod
    def is_better(a: float, b: float) -> bool:
        """A lower loss is better."""
        return a < b


class LearningRateMetric(Metric):
    """The learning rate (the same on every rank).

    Args:
        epoch_only: Logged once per epoch.
        initial_lr: The rate before the first update.
    """

    def __init__(self, epoch_only: bool, initial_lr: float = 0.0) -> None:
        super().__init__(epoch_only)
        self._lr = float(initial_lr)

    def reset(self) -> None:
        """Nothing to forget: the rate stays."""

    def update(self, lr: float) -> None:
        """The new rate."""
        self._lr = float(lr)

    def get_last_step_value(self) -> float:
        """The current rate."""
        return self._lr

    def get_accumulated_value(self) -> float:
        """The current rate."""
        return self._lr

    @staticmethod
    def is_better(a: float, b: float) -> bool:
        """No rate is better than another."""
        return False


class AccuracyMetric(Metric):
    """The share of correct predictions, over the data-parallel group.

    Args:
        epoch_only: Logged once per epoch.
        accuracy_func: ``(logits, targets) -> number of correct predictions`` (e.g.
            :class:`colossal.legacy.nn.metric.Accuracy`).
    """

    def __init__(
        self, epoch_only: bool, accuracy_func: Callable[[torch.Tensor, Any], torch.Tensor | int]
    ) -> None:
        super().__init__(epoch_only)
        self.accuracy_func = accuracy_func
        self._device = get_current_device()
        self.reset()

    def reset(self) -> None:
        """Forget the counts."""
        self._last = torch.zeros(2, dtype=torch.float64, device=self._device)  # correct, total
        self._total = torch.zeros(2, dtype=torch.float64, device=self._device)

    def update(
        self,
        logits: Logits,
        targets: object,
        batch_size: int | None = None,
    ) -> None:
        """Count a step's correct predictions.

        Args:
            logits: The model's output (the first item of a tuple or list).
            targets: The labels (the first item of a tuple or list), passed on as they are
                to ``accuracy_func`` otherwise (a dict for the seeds' ``MixupAccuracy``).
            batch_size: How many predictions were made; by default every position of
                ``logits`` but its last (class) dimension.
        """
        if isinstance(logits, list | tuple):
            logits = logits[0]
        if isinstance(targets, list | tuple):
            targets = targets[0]
        if batch_size is None:
            batch_size = math.prod(logits.shape[:-1])
        correct = self.accuracy_func(logits, targets)
        count = torch.as_tensor(correct, dtype=torch.float64).to(self._device)
        self._last[0] = count
        self._last[1] = batch_size
        self._total += self._last

    def get_last_step_value(self) -> float:
        """The last step's accuracy over the group (collective)."""
        last = dp_sum(self._last)
        return _ratio(last[0], last[1])

    def get_accumulated_value(self) -> float:
        """The accuracy over the group's steps since :meth:`reset` (collective)."""
        total = dp_sum(self._total)
        return _ratio(total[0], total[1])

    @staticmethod
    def is_better(a: float, b: float) -> bool:
        """A higher accuracy is better."""
        return a > b


class ThroughputMetric(Metric):
    """Samples per second (and TFLOPS when the work per step is known).

    Args:
        epoch_only: Logged once per epoch.
        ignored_steps: Steps at the start of each epoch that are not counted (warm-up).
        tflop_per_step: Tera floating-point operations of one step on one rank (0: unknown).
        use_local: This rank's throughput; otherwise the data-parallel group's (samples
            summed, time averaged).
    """

    def __init__(
        self,
        epoch_only: bool,
        ignored_steps: int = 0,
        tflop_per_step: float = 0.0,
        use_local: bool = False,
    ) -> None:
        super().__init__(epoch_only)
        if ignored_steps < 0:
            raise ValueError(f"ThroughputMetric: ignored_steps={ignored_steps} must be >= 0")
        self.ignored_steps = ignored_steps
        self.tflop_per_step = tflop_per_step
        self.use_local = use_local
        self._device = get_current_device()
        self.reset()

    def reset(self) -> None:
        """Forget the counts (the next ``ignored_steps`` steps are skipped again)."""
        self._seen = 0
        self._last = torch.zeros(3, dtype=torch.float64, device=self._device)  # n, s, steps
        self._total = torch.zeros(3, dtype=torch.float64, device=self._device)

    def update(self, num_samples: int, used_time: float) -> None:
        """A step of ``num_samples`` samples that took ``used_time`` seconds."""
        self._seen += 1
        self._last = torch.tensor(
            [float(num_samples), float(used_time), 1.0], dtype=torch.float64, device=self._device
        )
        if self._seen > self.ignored_steps:
            self._total += self._last

    def _value(self, counts: torch.Tensor) -> torch.Tensor:
        if self.use_local:
            return counts
        summed = dp_sum(counts, ParallelMode.DATA)  # sequence-parallel ranks share samples
        summed[1:] /= _size(ParallelMode.DATA)  # time and steps: the ranks' mean
        return summed

    def get_last_step_value(self) -> float:
        """Samples per second of the last step."""
        counts = self._value(self._last)
        return _ratio(counts[0], counts[1])

    def get_accumulated_value(self) -> float:
        """Samples per second over the counted steps."""
        counts = self._value(self._total)
        return _ratio(counts[0], counts[1])

    def get_accumulated_tflops(self) -> float:
        """TFLOPS of this rank over the counted steps (nan when ``tflop_per_step`` is 0)."""
        counts = self._value(self._total)
        if self.tflop_per_step <= 0:
            return math.nan
        return _ratio(self.tflop_per_step * counts[2], counts[1])

    @staticmethod
    def is_better(a: float, b: float) -> bool:
        """Higher throughput is better."""
        return a > b
