"""BaseSchedule: how one batch goes through the engine (load, forward, loss, backward)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch

from colossal.core import get_accelerator

if TYPE_CHECKING:
    from colossal.legacy.engine.engine import Engine

__all__ = [
    "BaseSchedule",
    "Batch",
    "StepResult",
    "call_criterion",
    "call_model",
    "move_to_device",
]

#: What ``data_process_func`` returns and a plain batch is: ``(data, label)``, each a tensor,
#: a tuple/list or a dict (of tensors or anything the model and the criterion take).
Batch = tuple[object, object]
#: The step's result: ``(output, label, loss)``. The output is whatever the model returned
#: and the label whatever the batch held (None where not returned), so both stay ``Any``.
StepResult = tuple[Any, Any, torch.Tensor | None]

_T = TypeVar("_T")
_R = TypeVar("_R")


def move_to_device(obj: _T, device: torch.device) -> _T:
    """``obj`` with every tensor (through tuples, lists and dicts) moved to ``device``.

    The structure is kept: lists stay lists and tuples tuples; a mapping comes back as a
    ``dict`` of the same keys.
    """
    if isinstance(obj, torch.Tensor):
        return cast(_T, obj.to(device, non_blocking=True))
    if isinstance(obj, Mapping):
        return cast(_T, {k: move_to_device(v, device) for k, v in obj.items()})
    if isinstance(obj, (list, tuple)):
        moved = [move_to_device(v, device) for v in obj]
        return cast(_T, moved if isinstance(obj, list) else tuple(moved))
    return obj


def call_model(model: Callable[..., _R], data: object) -> _R:
    """``model(data)``; a tuple/list is passed as positional, a dict as keyword arguments."""
    if isinstance(data, Mapping):
        return model(**data)
    if isinstance(data, (list, tuple)):
        return model(*data)
    return model(data)


def _as_arguments(value: object) -> Mapping[str, object] | Sequence[object]:
    """A dict or tuple/list as it is (keyword or positional arguments); anything else alone."""
    if isinstance(value, torch.Tensor) or not isinstance(value, (Mapping, list, tuple)):
        return (value,)
    return value


def call_criterion(
    criterion: Callable[..., torch.Tensor], outputs: object, labels: object
) -> torch.Tensor:
    """The loss of ``outputs`` against ``labels``, unpacked as ColossalAI's schedules do.

    Tensors are single arguments, tuples/lists positional ones, dicts keyword ones:
    ``criterion(*outputs, *labels)`` or ``criterion(*outputs, **labels)`` or
    ``criterion(**outputs, **labels)``; ``labels=None`` passes the outputs only.

    Raises:
        TypeError: A dict of outputs with positional labels (their order is unknown).
    """
    output_args = _as_arguments(outputs)
    label_args = () if labels is None else _as_arguments(labels)
    if isinstance(output_args, Mapping):
        if not isinstance(label_args, Mapping):
            raise TypeError(
                "the model returned a dict but the labels are positional; return a tuple "
                "from the model or give the labels as a dict"
            )
        return criterion(**output_args, **label_args)
    if isinstance(label_args, Mapping):
        return criterion(*output_args, **label_args)
    return criterion(*output_args, *label_args)


class BaseSchedule(ABC):
    """Runs forward, loss and backward of one batch for an :class:`Engine`.

    A batch is ``(data, label)``: data is a tensor (``model(data)``), a tuple
    (``model(*data)``) or a dict (``model(**data)``); the label likewise for the criterion.
    Give ``data_process_func(batch) -> (data, label)`` for other layouts.

    Args:
        data_process_func: Turns a batch from the data iterator into ``(data, label)``.
    """

    def __init__(self, data_process_func: Callable[[Any], Batch] | None = None) -> None:
        # Any: the function takes the user's batch as it comes (typed by its author).
        self.data_process_func = data_process_func

    def load_batch(self, data_iter: Iterator[object] | None, to_gpu: bool = True) -> Batch:
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
        data_iter: Iterator[object],
        forward_only: bool = False,
        return_loss: bool = True,
        return_output_label: bool = True,
    ) -> StepResult:
        """Run one batch; return ``(output, label, loss)`` (None where not asked for)."""

    @staticmethod
    def _check_flags(forward_only: bool, return_loss: bool) -> None:
        if not forward_only and not return_loss:
            raise ValueError(
                "return_loss=False needs forward_only=True: the backward needs the loss"
            )
