"""``TensorboardHook``: writes the metrics as TensorBoard scalars (needs ``tensorboard``)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from colossal.legacy.context import ParallelMode
from colossal.legacy.core import gpc
from colossal.legacy.registry import HOOKS
from colossal.legacy.trainer.hooks.base import BaseHook
from colossal.legacy.trainer.hooks.log_hooks import metric_values
from colossal.legacy.utils.common import is_no_pp_or_last_stage

if TYPE_CHECKING:
    import torch
    from torch.utils.tensorboard import SummaryWriter

    from colossal.legacy.trainer.trainer import Trainer

__all__ = ["TensorboardHook"]

_MISSING = (
    "TensorboardHook needs the tensorboard package: pip install tensorboard "
    "(or pip install 'colossal-legacy[tensorboard]')"
)


def summary_writer_class() -> type[SummaryWriter]:
    """``torch.utils.tensorboard.SummaryWriter``.

    Raises:
        ImportError: tensorboard is not installed (the message says how to install it).
    """
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:  # torch raises it when tensorboard is missing
        raise ImportError(_MISSING) from err
    return SummaryWriter


@HOOKS.register_module
class TensorboardHook(BaseHook):
    """Writes each step's training metrics and each epoch's metrics to TensorBoard.

    Ranks whose local rank in ``parallel_mode`` is in ``ranks`` (every rank when None) on
    the last pipeline stage write into ``log_dir/<mode>_rank_<rank>``. Values are read on
    every rank (reading a reduced metric is a collective).

    Args:
        log_dir: The TensorBoard directory.
        ranks: Local ranks in ``parallel_mode`` that write (None: all).
        parallel_mode: The mode ``ranks`` refers to.
        priority: Lower values run earlier.

    Raises:
        ImportError: tensorboard is not installed.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        ranks: Sequence[int] | None = None,
        parallel_mode: ParallelMode = ParallelMode.GLOBAL,
        priority: int = 10,
    ) -> None:
        super().__init__(priority)
        writer_class = summary_writer_class()
        if parallel_mode is ParallelMode.GLOBAL or not gpc.is_initialized(parallel_mode):
            rank = gpc.get_global_rank()
        else:
            rank = gpc.get_local_rank(parallel_mode)
        self._writer: SummaryWriter | None = None
        if (ranks is None or rank in ranks) and is_no_pp_or_last_stage():
            path = os.path.join(os.fspath(log_dir), f"{parallel_mode.value}_rank_{rank}")
            self._writer = writer_class(log_dir=path, filename_suffix=f"_rank_{rank}")

    def _write(self, trainer: Trainer, mode: str, step: int, epoch_only: bool | None) -> None:
        metrics = trainer.states.get("metrics", {}).get(mode, {})
        names = [n for n, m in metrics.items() if epoch_only is None or m.epoch_only == epoch_only]
        if not names:
            return
        values = metric_values(trainer, mode, names)
        if self._writer is None:
            return
        for name in names:
            self._writer.add_scalar(f"{name}/{mode}", values[name], step)

    def after_train_iter(
        self, trainer: Trainer, output: object, label: object, loss: torch.Tensor | None
    ) -> None:
        """Per-step training metrics, at the global step."""
        self._write(trainer, "train", trainer.cur_step, epoch_only=False)

    def after_train_epoch(self, trainer: Trainer) -> None:
        """Epoch-only training metrics, at the epoch."""
        self._write(trainer, "train", trainer.cur_epoch, epoch_only=True)

    def after_test_epoch(self, trainer: Trainer) -> None:
        """Test metrics, at the epoch."""
        self._write(trainer, "test", trainer.cur_epoch, epoch_only=None)

    def after_train(self, trainer: Trainer) -> None:
        """Flush the writer."""
        if self._writer is not None:
            self._writer.flush()
