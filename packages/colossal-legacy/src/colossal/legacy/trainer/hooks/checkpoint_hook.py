"""``SaveCheckpointHook``: saves the training state with ``utils.save_checkpoint``."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from torch import nn

from colossal.legacy.registry import HOOKS
from colossal.legacy.trainer.hooks.base import BaseHook
from colossal.legacy.trainer.hooks.metric_hooks import LRSchedulerHook
from colossal.legacy.utils.checkpointing import SchedulerLike, save_checkpoint

if TYPE_CHECKING:
    import torch

    from colossal.legacy.trainer.trainer import Trainer

__all__ = ["SaveCheckpointHook"]


@HOOKS.register_module
class SaveCheckpointHook(BaseHook):
    """Saves model, optimizer and lr scheduler into ``checkpoint_dir`` every ``interval``.

    Each save replaces the previous one in the same directory (see
    :func:`colossal.legacy.utils.save_checkpoint` for its layout; a Booster can load it).
    The lr scheduler is the one of the Trainer's :class:`LRSchedulerHook`, if any. The epoch
    saved is the one running (just completed, when saving by epoch), and the extra value
    ``step`` the number of training steps done (:func:`~colossal.legacy.utils.
    read_training_state`). Saving is collective: the hook runs on every rank.

    Args:
        interval: Save after every ``interval`` epochs (or steps with ``save_by_iter``).
        checkpoint_dir: The checkpoint directory.
        model: The model to save (the engine's by default).
        save_by_iter: Count steps instead of epochs.
        priority: Lower values run earlier.

    Raises:
        ValueError: No ``checkpoint_dir``, or ``interval`` < 1.
    """

    def __init__(
        self,
        interval: int = 1,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        model: nn.Module | None = None,
        save_by_iter: bool = False,
        priority: int = 10,
    ) -> None:
        super().__init__(priority)
        if checkpoint_dir is None:
            raise ValueError("SaveCheckpointHook needs checkpoint_dir=... (a directory)")
        if interval < 1:
            raise ValueError(f"SaveCheckpointHook: interval={interval} must be >= 1")
        self.interval = interval
        self.checkpoint_dir = os.fspath(checkpoint_dir)
        self.model = model
        self.save_by_iter = save_by_iter
        self._lr_scheduler: SchedulerLike | None = None

    def after_hook_is_attached(self, trainer: Trainer) -> None:
        """Pick the model and the lr scheduler."""
        if self.model is None:
            self.model = trainer.engine.model
        for hook in trainer.hooks:
            if isinstance(hook, LRSchedulerHook):
                self._lr_scheduler = hook.lr_scheduler
                break

    def _save(self, trainer: Trainer, steps_done: int) -> None:
        assert self.model is not None  # set in after_hook_is_attached
        save_checkpoint(
            self.checkpoint_dir,
            trainer.cur_epoch,
            self.model,
            trainer.engine.optimizer,
            self._lr_scheduler,
            step=steps_done,
        )

    def after_train_iter(
        self, trainer: Trainer, output: object, label: object, loss: torch.Tensor | None
    ) -> None:
        """Save every ``interval`` steps (``save_by_iter``)."""
        if self.save_by_iter and (trainer.cur_step + 1) % self.interval == 0:
            self._save(trainer, trainer.cur_step + 1)

    def after_train_epoch(self, trainer: Trainer) -> None:
        """Save every ``interval`` epochs."""
        if not self.save_by_iter and (trainer.cur_epoch + 1) % self.interval == 0:
            self._save(trainer, trainer.cur_step)
