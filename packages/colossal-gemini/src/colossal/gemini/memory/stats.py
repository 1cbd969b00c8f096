"""What a traced forward/backward used, step by step: non-model memory and the next-use table."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

Phase = Literal["forward", "backward"]

_T_co = TypeVar("_T_co", covariant=True)
_U = TypeVar("_U")


@dataclass(frozen=True)
class StepRecord(Generic[_T_co]):
    """One traced step: a module's forward or backward (module-level granularity).

    Attributes:
        index: Position of the step in the trace (0-based).
        phase: ``"forward"`` or ``"backward"``.
        label: Qualified name of the module the step belongs to (``"<start>"`` for work before
            the first module of a phase).
        start_bytes: Live non-model bytes when the step began.
        end_bytes: Live non-model bytes when the step ended.
        peak_bytes: Most live non-model bytes at any point during the step.
        uses: The parameters (or, after :meth:`MemStats.remap`, chunks) the step used, in
            order of first use within the step, without duplicates.
    """

    index: int
    phase: Phase
    label: str
    start_bytes: int
    end_bytes: int
    peak_bytes: int
    uses: tuple[_T_co, ...] = field(default=())


class MemStats(Generic[_T_co]):
    """Non-model memory per traced step and the order in which model data is used.

    "Non-model" memory is everything a step keeps live except model data (parameters,
    their gradients, buffers): activations, inputs and temporaries. The auto placement policy
    reserves :meth:`non_model_bytes` of the device for the step it is placing chunks for, and
    evicts the chunks whose :meth:`next_use` is furthest away.

    Objects in ``uses`` are matched by identity (parameters compare element-wise, so never by
    ``==``).

    Args:
        steps: The step records in trace order; their ``index`` must be 0, 1, 2, ...

    Raises:
        ValueError: The step indices are not consecutive from 0.
    """

    def __init__(self, steps: Iterable[StepRecord[_T_co]] = ()) -> None:
        self._steps: tuple[StepRecord[_T_co], ...] = tuple(steps)
        for i, rec in enumerate(self._steps):
            if rec.index != i:
                raise ValueError(f"step record {i} has index {rec.index}; indices must be 0..n-1")
        self._use_index: dict[int, list[int]] = {}
        self._objects: dict[int, _T_co] = {}
        for rec in self._steps:
            for obj in rec.uses:
                self._objects.setdefault(id(obj), obj)
                steps_of = self._use_index.setdefault(id(obj), [])
                if not steps_of or steps_of[-1] != rec.index:
                    steps_of.append(rec.index)

    # ---- steps -------------------------------------------------------------------------------
    @property
    def steps(self) -> tuple[StepRecord[_T_co], ...]:
        """All step records in trace order."""
        return self._steps

    def __len__(self) -> int:
        return len(self._steps)

    def _check_step(self, step: int) -> None:
        if not 0 <= step < len(self._steps):
            raise IndexError(f"step {step} is outside the trace of {len(self._steps)} steps")

    def non_model_bytes(self, step: int) -> int:
        """Peak live non-model bytes during ``step``.

        Raises:
            IndexError: ``step`` is not in ``[0, len(self))``.
        """
        self._check_step(step)
        return self._steps[step].peak_bytes

    @property
    def peak_non_model_bytes(self) -> int:
        """The largest non-model peak over all steps (0 for an empty trace)."""
        return max((rec.peak_bytes for rec in self._steps), default=0)

    def uses(self, step: int) -> tuple[_T_co, ...]:
        """What ``step`` used, in order of first use within the step."""
        self._check_step(step)
        return self._steps[step].uses

    # ---- the next-use table ---------------------------------------------------------------
    def use_steps(self, obj: object) -> tuple[int, ...]:
        """Every step that used ``obj``, ascending (empty when never used)."""
        return tuple(self._use_index.get(id(obj), ()))

    def next_use(self, obj: object, step: int) -> int | None:
        """The first step at or after ``step`` that uses ``obj``.

        Args:
            obj: A parameter, or a chunk after :meth:`remap`.
            step: The current step; a step using ``obj`` right now counts as its next use.

        Returns:
            The step index, or ``None`` when ``obj`` is not used again in the trace.
        """
        steps_of = self._use_index.get(id(obj))
        if not steps_of:
            return None
        pos = bisect.bisect_left(steps_of, step)
        return steps_of[pos] if pos < len(steps_of) else None

    def first_use_order(self, phase: Phase | None = None) -> list[_T_co]:
        """Distinct used objects in order of first use (optionally within one phase only).

        This is the "order of first use" chunks are packed in.
        """
        seen: set[int] = set()
        order: list[_T_co] = []
        for rec in self._steps:
            if phase is not None and rec.phase != phase:
                continue
            for obj in rec.uses:
                if id(obj) not in seen:
                    seen.add(id(obj))
                    order.append(obj)
        return order

    def remap(self, key: Callable[[_T_co], _U | None]) -> MemStats[_U]:
        """The same trace with every used object replaced by ``key(obj)`` (e.g. its chunk).

        Objects mapped to ``None`` are dropped; several objects mapping to one key (the
        parameters of one chunk) appear once per step.

        Args:
            key: Maps a used object to what should be tracked instead, e.g.
                ``chunk_manager.chunk_of``.

        Returns:
            A new :class:`MemStats` with the same memory figures.
        """
        new_steps = []
        for rec in self._steps:
            mapped: list[_U] = []
            seen: set[int] = set()
            for obj in rec.uses:
                target = key(obj)
                if target is not None and id(target) not in seen:
                    seen.add(id(target))
                    mapped.append(target)
            new_steps.append(
                StepRecord(
                    rec.index, rec.phase, rec.label, rec.start_bytes, rec.end_bytes,
                    rec.peak_bytes, tuple(mapped),
                )
            )
        return MemStats(new_steps)

    def summary(self, names: Sequence[tuple[object, str]] = ()) -> str:
        """A small text table of the steps (for logs and ``verbose``).

        Args:
            names: Optional ``(object, name)`` pairs used to print what each step used.
        """
        by_id = {id(obj): name for obj, name in names}
        lines = ["step  phase     peak_bytes  label  uses"]
        for rec in self._steps:
            used = ", ".join(by_id.get(id(o), type(o).__name__) for o in rec.uses)
            lines.append(
                f"{rec.index:4d}  {rec.phase:8s}  {rec.peak_bytes:10d}  {rec.label}  [{used}]"
            )
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"MemStats(steps={len(self)}, peak_non_model_bytes={self.peak_non_model_bytes})"
