"""BaseSchedule: how one batch goes through the engine (load, forward, loss, backward)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from colossal.core import get_accelerator

if TYPE_CHECKING:
    from colossal.legacy.engine.engine import Engine

__all__ = ["BaseSchedule", "Batch", "call_criterion", "call_model", "move_to_device"]

#: What ``data_process_func`` returns and a plain batch is: ``(data, label)``.
Batch = tuple[Any, Any]


def move_to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor (through tuples, lists and dicts) moved to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, Mapping):
        return {k: move_to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        moved = [move_to_device(v, device) for v in obj]
        return moved if isinstance(obj, list) else tuple(moved)
    return obj


def call_model(model: Callable[..., Any], data: Any) -> Any:
    """``model(data)``; a tuple/list is passed as positional, a dict as keyword arguments."""
    if isinstance(data, Mapping):
        return model(**data)
    if isinstance(data, (list, tuple)):
        return model(*data)
    return model(data)


def call_criterion(criterion: Callable[..., torch.Tensor], outputs: Any, labels: Any) -> Any:
    """The loss of ``outputs`` against ``labels``, unpacked as ColossalAI's schedules do.

    Tensors are single arguments, tuples/lists positional ones, dicts keyword ones:
    ``criterion(*outputs, *labels)`` or ``criterion(*outputs, **labels)`` or
    ``criterion(**outputs, **labels)``; ``labels=None`` passes the outputs only.

    Raises:
        TypeError: A dict of outputs with positional labels (their order is unknown).
    """
    if isinstance(outputs, torch.Tensor) or not isinstance(outputs, (Mapping, list, tuple)):
        outputs = (outputs,)
    if labels is None:
        labels = ()
    elif isinstance(labels, torch.Tensor) or not isinstance(labels, (Mapping, list, tuple)):
        labels = (labels,)
    if isinstance(outputs, Mapping):
        if not isinstance(labels, Mapping):
            raise TypeError(
                "the model returned a dict but the labels are positional; return a tuple "
                "from the model or give the labels as a dict"
            )
        return criterion(**outputs, **labels)
    if isinstance(labels, Mapping):
        return criterion(*outputs, **labels)
    return criterion(*outputs, *labels)


class BaseSchedule(ABC):
    """Runs forward, loss and backward of one batch for an :class:`Engine`.

    A batch is ``(data, label)``: data is a tensor (``model(data)``), a tuple
    (``model(*data)``) or a dict (``model(**data)``); the label likewise for the criterion.
    Give ``data_process_func(batch) -> (data, label)`` for other layouts.

    Args:
        data_process_func: Turns a batch from the data iterator into ``(data, label)``.
    """

    def __init__(self, data_process_func: Callable[[Any], Batch] | None = None) -> None:
        self.data_process_func = data_process_func

    def load_batch(self, data_iter: Iterator[Any] | None, to_gpu: bool = True) -> Batch:
        """The next batch of ``data_iter`` as ``(data, label)``, on the accelerator's device.

        Raises:
            RuntimeError: ``data_iter`` is None.
            TypeError: The batch is not ``(data, label)`` and no ``data_process_func`` is set.
        """
        if data_iter is None:
            raise RuntimeError("the data iterator is None; pass iter(dataloader)")
        batch = next(data_iter)
        if to_gpu:
            batch = move_to_device(batch, get_accelerator().get_current_device())
        if self.data_process_func is not None:
            batch = self.data_process_func(batch)
        if isinstance(batch, Sequence) and not isinstance(batch, str) and len(batch) == 2:
            return batch[0], batch[1]
        raise TypeError(
            f"a batch must be (data, label), got {type(batch).__name__}; pass "
            "data_process_func=lambda batch: (data, label) to the schedule"
        )

    def pre_processing(self, engine: Engine) -> None:
        """Prepare for ``engine`` (called once, when the Engine is created); nothing here."""
        return None

    @abstractmethod
    def forward_backward_step(
        self,
        engine: Engine,
        data_iter: Iterator[Any],
        forward_only: bool = False,
        return_loss: bool = True,
        return_output_label: bool = True,
    ) -> tuple[Any, Any, torch.Tensor | None]:
        """Run one batch; return ``(output, label, loss)`` (None where not asked for)."""

    @staticmethod
    def _check_flags(forward_only: bool, return_loss: bool) -> None:
        if not forward_only and not return_loss:
            raise ValueError(
                "return_loss=False needs forward_only=True: the backward needs the loss"
            )
