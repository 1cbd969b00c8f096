"""``BaseHook``: the life-cycle methods the Trainer calls; subclass it for your own hooks.

The Trainer calls, in this order (``fit``)::

    after_hook_is_attached
    before_train
    per epoch:  before_train_epoch
                per step: before_train_iter, after_train_iter(output, label, loss)
                after_train_epoch
                when testing this epoch:
                    before_test, before_test_epoch
                    per step: before_test_iter, after_test_iter(output, label, loss)
                    after_test_epoch, after_test
    after_train

``evaluate`` calls ``after_hook_is_attached`` and the testing part. Hooks run in ascending
``priority`` (a lower value runs earlier); equal priorities keep the order of the list.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from colossal.legacy.trainer.trainer import Trainer

__all__ = ["BaseHook"]


class BaseHook:
    """A hook: override the life-cycle methods of interest (each does nothing here).

    A subclass whose ``__init__`` does not call ``super().__init__`` (as the seeds'
    ``LogMessageHook``) gets the class default ``priority = 10``.

    Args:
        priority: Lower values run earlier.
    """

    priority: int = 10

    def __init__(self, priority: int) -> None:
        self.priority = priority

    def after_hook_is_attached(self, trainer: Trainer) -> None:
        """Once the Trainer holds its hooks, before anything runs."""

    def before_train(self, trainer: Trainer) -> None:
        """Before the first training epoch."""

    def after_train(self, trainer: Trainer) -> None:
        """After the last training epoch (or ``max_steps``)."""

    def before_train_epoch(self, trainer: Trainer) -> None:
        """Before each training epoch."""

    def after_train_epoch(self, trainer: Trainer) -> None:
        """After each training epoch (before its testing)."""

    def before_train_iter(self, trainer: Trainer) -> None:
        """Before each training step."""

    def after_train_iter(
        self, trainer: Trainer, output: Any, label: Any, loss: torch.Tensor | None
    ) -> None:
        """After each training step (and its optimizer step).

        ``output`` and ``label`` are the user's (whatever the model returns and the batch
        holds), so they are ``Any``: an override may annotate them as its model's types.

        Args:
            trainer: The Trainer.
            output: The model's output (None with ``return_output_label=False``).
            label: The batch's label (None with ``return_output_label=False``).
            loss: The step's loss (None on pipeline stages other than the last).
        """

    def before_test(self, trainer: Trainer) -> None:
        """Before a test run."""

    def after_test(self, trainer: Trainer) -> None:
        """After a test run."""

    def before_test_epoch(self, trainer: Trainer) -> None:
        """Before the steps of a test run."""

    def after_test_epoch(self, trainer: Trainer) -> None:
        """After the steps of a test run."""

    def before_test_iter(self, trainer: Trainer) -> None:
        """Before each test step."""

    def after_test_iter(
        self, trainer: Trainer, output: Any, label: Any, loss: torch.Tensor | None
    ) -> None:
        """After each test step (arguments as in :meth:`after_train_iter`)."""

    def init_runner_states(self, trainer: Trainer, key: str, val: object) -> None:
        """Set ``trainer.states[key] = val`` unless the key exists already."""
        if key not in trainer.states:
            trainer.states[key] = val

    def __repr__(self) -> str:
        return f"{type(self).__name__}(priority={self.priority})"
