"""Gradient accumulation's dataloader, lr scheduler and gradient handler wrappers."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sized
from typing import Any, Generic, TypeVar

from torch.optim.lr_scheduler import LRScheduler

from colossal.legacy.engine.gradient_accumulation.optimizer import GradAccumOptimizer
from colossal.legacy.engine.gradient_handler.base import BaseGradientHandler

__all__ = ["GradAccumDataloader", "GradAccumGradientHandler", "GradAccumLrSchedulerByStep"]

_BatchT = TypeVar("_BatchT")


def _check_size(accumulate_size: int) -> None:
    if (
        isinstance(accumulate_size, bool)
        or not isinstance(accumulate_size, int)
        or (accumulate_size < 1)
    ):
        raise ValueError(f"accumulate_size={accumulate_size!r} must be an int >= 1")


class GradAccumDataloader(Generic[_BatchT]):
    """A dataloader whose epochs hold a whole number of accumulation cycles.

    An epoch still yields one batch per micro-step (its length is the dataloader's), except
    the last ``len(dataloader) % accumulate_size`` batches, which would start a cycle the
    epoch cannot finish: they are read and dropped. Other attributes (``sampler``,
    ``dataset``, ``batch_size``...) are the dataloader's. A dataloader without a length is
    passed through.

    Args:
        dataloader: The dataloader.
        accumulate_size: Micro-steps per optimizer step.

    Raises:
        ValueError: The dataloader has fewer batches than ``accumulate_size``.
    """

    def __init__(self, dataloader: Iterable[_BatchT], accumulate_size: int) -> None:
        _check_size(accumulate_size)
        self.dataloader = dataloader
        self.accumulate_size = accumulate_size
        if isinstance(dataloader, Sized) and len(dataloader) < accumulate_size:
            raise ValueError(
                f"the dataloader has {len(dataloader)} batches, fewer than "
                f"gradient_accumulation={accumulate_size}: no optimizer step would happen; "
                "use a larger dataset or a smaller gradient_accumulation"
            )

    def __len__(self) -> int:
        if not isinstance(self.dataloader, Sized):
            raise TypeError("the wrapped dataloader has no length")
        n = len(self.dataloader)
        return n - n % self.accumulate_size

    def __iter__(self) -> Iterator[_BatchT]:
        it = iter(self.dataloader)
        if not isinstance(self.dataloader, Sized):
            yield from it
            return
        for _ in range(len(self)):
            yield next(it)
        for _ in it:  # drop the incomplete cycle (and let the loader finish its epoch)
            pass

    def __getattr__(self, name: str) -> Any:
        """The dataloader's attribute ``name`` (any attribute: whatever its type)."""
        loader = self.__dict__.get("dataloader")
        if loader is None:
            raise AttributeError(name)
        return getattr(loader, name)


class GradAccumLrSchedulerByStep:
    """An lr scheduler that steps only when the optimizer did.

    Call :meth:`step` after every micro-step (a by-step scheduler) or every epoch (a
    by-epoch one): the scheduler steps at most once per optimizer update since its last
    step. Without ``optimizer``, it steps every ``accumulate_size``-th call.

    Args:
        lr_scheduler: The scheduler.
        accumulate_size: Micro-steps per optimizer step.
        optimizer: The accumulating optimizer whose updates it follows.
    """

    def __init__(
        self,
        lr_scheduler: LRScheduler,
        accumulate_size: int,
        optimizer: GradAccumOptimizer | None = None,
    ) -> None:
        _check_size(accumulate_size)
        self.lr_scheduler = lr_scheduler
        self.accumulate_size = accumulate_size
        self.optimizer = optimizer
        self._seen_updates = optimizer.num_updates if optimizer is not None else 0
        self._calls = 0

    @staticmethod
    def compute_effective_steps_per_epoch(dataloader: Sized, accumulate_size: int) -> int:
        """Optimizer steps per epoch of ``dataloader``."""
        return len(dataloader) // accumulate_size

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Step the scheduler if the optimizer stepped since the last time (see above)."""
        if self.optimizer is not None:
            if self.optimizer.num_updates == self._seen_updates:
                return
            self._seen_updates = self.optimizer.num_updates
        else:
            self._calls += 1
            if self._calls < self.accumulate_size:
                return
            self._calls = 0
        self.lr_scheduler.step(*args, **kwargs)

    def state_dict(self) -> dict[str, object]:
        """The scheduler's state dict."""
        state: dict[str, object] = self.lr_scheduler.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, object]) -> None:
        """Restore the scheduler's state."""
        self.lr_scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        """The scheduler's attribute ``name`` (any attribute: whatever its type)."""
        scheduler = self.__dict__.get("lr_scheduler")
        if scheduler is None:
            raise AttributeError(name)
        return getattr(scheduler, name)


class GradAccumGradientHandler(BaseGradientHandler):
    """Runs a gradient handler on the last micro-step of every cycle only.

    Args:
        grad_handler: The handler.
        accumulate_size: Micro-steps per optimizer step.
    """

    def __init__(self, grad_handler: BaseGradientHandler, accumulate_size: int) -> None:
        _check_size(accumulate_size)
        super().__init__(grad_handler._model, grad_handler._optimizer)
        self.grad_handler = grad_handler
        self.accumulate_size = accumulate_size
        self.accumulate_step = 0

    def handle_gradient(self) -> None:
        """Count the micro-step; handle the gradients on the last one."""
        self.accumulate_step += 1
        if self.accumulate_step < self.accumulate_size:
            return
        self.accumulate_step = 0
        self.grad_handler.handle_gradient()
