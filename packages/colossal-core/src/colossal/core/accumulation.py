"""The gradient-accumulation contract shared by optimizers, models and pipeline schedules.

An object that can add several backward passes' gradients up locally, without reducing them
over its data-parallel group until the last one, implements :class:`GradientAccumulator`:
``no_sync()`` is the context in which backwards accumulate, ``accumulating`` says whether
one is open. ZeRO's optimizer and Gemini's model implement it; a pipeline schedule runs
every microbatch but the last inside ``no_sync()``, and a plugin asks ``accumulating`` to
know whether the step's reductions are still to come.
"""

from __future__ import annotations

import contextlib
from typing import Protocol, runtime_checkable

__all__ = ["GradientAccumulator", "is_accumulating"]


@runtime_checkable
class GradientAccumulator(Protocol):
    """Accumulates gradients locally over several backward passes.

    ``no_sync()`` may raise ``RuntimeError`` when the implementation cannot accumulate with
    its settings (ZeRO stage 2 keeps no local gradients), naming what to change.
    """

    def no_sync(self) -> contextlib.AbstractContextManager[object]:
        """Context in which backward passes accumulate without communication."""
        ...

    @property
    def accumulating(self) -> bool:
        """Whether backward passes now accumulate locally (inside :meth:`no_sync`)."""
        ...


def is_accumulating(obj: object) -> bool:
    """``obj.accumulating`` for a :class:`GradientAccumulator`, False for anything else."""
    return isinstance(obj, GradientAccumulator) and bool(obj.accumulating)
