"""Schedules as data: per stage, the ordered list of actions it runs in one training step."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from colossal.pipeline.layout import StageLayout


class ActionType(str, Enum):
    """What one action of a pipeline schedule does."""

    FORWARD = "F"
    BACKWARD = "B"
    """Full backward: input and weight gradients at once."""
    BACKWARD_INPUT = "I"
    """Backward for the chunk's inputs only (zero-bubble split); the graph is kept."""
    BACKWARD_WEIGHT = "W"
    """Backward for the chunk's parameters (after its ``BACKWARD_INPUT``)."""
    SEND_FORWARD = "SF"
    RECV_FORWARD = "RF"
    SEND_BACKWARD = "SB"
    RECV_BACKWARD = "RB"

    @property
    def is_compute(self) -> bool:
        """Whether the action runs the model (as opposed to communicating)."""
        return self in COMPUTE

    @property
    def is_comm(self) -> bool:
        """Whether the action sends or receives."""
        return not self.is_compute


COMPUTE = frozenset(
    {ActionType.FORWARD, ActionType.BACKWARD, ActionType.BACKWARD_INPUT, ActionType.BACKWARD_WEIGHT}
)
SENDS = frozenset({ActionType.SEND_FORWARD, ActionType.SEND_BACKWARD})
RECVS = frozenset({ActionType.RECV_FORWARD, ActionType.RECV_BACKWARD})


@dataclass(frozen=True)
class Action:
    """One step of one stage: a compute or a transfer for microbatch ``microbatch`` of ``chunk``.

    For ``SEND_FORWARD`` the activation is the output of ``(microbatch, chunk)``; for
    ``RECV_FORWARD`` it is the input of ``(microbatch, chunk)``; likewise for gradients.

    Attributes:
        type: The action type.
        microbatch: Microbatch index, ``0 <= microbatch < M``.
        chunk: This stage's local model chunk index.
    """

    type: ActionType
    microbatch: int
    chunk: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.type, ActionType):
            raise TypeError(f"Action.type must be an ActionType, got {self.type!r}")
        if self.microbatch < 0 or self.chunk < 0:
            raise ValueError(
                f"microbatch and chunk must be >= 0, got {self.microbatch}, {self.chunk}"
            )

    def __str__(self) -> str:
        return f"{self.type.value}{self.microbatch}.{self.chunk}"


@dataclass(frozen=True)
class TimelineEvent:
    """One action as it ran (or was simulated) on a stage, with start and end times.

    Attributes:
        stage: Pipeline stage.
        action: The action.
        start: Start time in seconds (or cost units when simulated).
        end: End time.
    """

    stage: int
    action: Action
    start: float
    end: float

    @property
    def duration(self) -> float:
        """``end - start``."""
        return self.end - self.start


@dataclass(frozen=True)
class ScheduleIR:
    """A whole pipeline schedule: for every stage, the actions it runs in order.

    Attributes:
        name: Schedule name (e.g. ``"1f1b"``).
        layout: Where the model slices live.
        num_microbatches: Microbatches per step.
        actions: One tuple of actions per stage.
    """

    name: str
    layout: StageLayout
    num_microbatches: int
    actions: tuple[tuple[Action, ...], ...]

    def __post_init__(self) -> None:
        if not isinstance(self.num_microbatches, int) or self.num_microbatches < 1:
            raise ValueError(
                f"num_microbatches must be a positive int, got {self.num_microbatches!r}"
            )
        if len(self.actions) != self.layout.num_stages:
            raise ValueError(
                f"a schedule for {self.layout.num_stages} stages needs {self.layout.num_stages} "
                f"action lists, got {len(self.actions)}"
            )

    @property
    def num_stages(self) -> int:
        """Pipeline stages."""
        return self.layout.num_stages

    @property
    def num_chunks(self) -> int:
        """Model chunks per stage."""
        return self.layout.num_chunks

    def slice_of(self, stage: int, action: Action) -> int:
        """The model slice an action of ``stage`` works on."""
        return self.layout.slice_of(stage, action.chunk)

    def peer(self, stage: int, action: Action) -> int | None:
        """The stage on the other side of a transfer (``None`` for compute actions)."""
        t = action.type
        if t.is_compute:
            return None
        v = self.slice_of(stage, action)
        other = v + 1 if t in (ActionType.SEND_FORWARD, ActionType.RECV_BACKWARD) else v - 1
        return self.layout.locate(other)[0]

    def channel(self, stage: int, action: Action) -> int:
        """Tag of the transfer: ``2v`` for activations ``v -> v+1``, ``2v+1`` for their grads."""
        v = self.slice_of(stage, action)
        t = action.type
        if t == ActionType.SEND_FORWARD:
            return 2 * v
        if t == ActionType.RECV_FORWARD:
            return 2 * (v - 1)
        if t == ActionType.SEND_BACKWARD:
            return 2 * (v - 1) + 1
        if t == ActionType.RECV_BACKWARD:
            return 2 * v + 1
        raise ValueError(f"{action} is not a transfer")

    def compute_actions(self, stage: int) -> list[Action]:
        """The compute actions of ``stage`` in order."""
        return [a for a in self.actions[stage] if a.type.is_compute]

    def format(self, compute_only: bool = False) -> str:
        """One line per stage listing its actions (``F3.1`` = forward, microbatch 3, chunk 1)."""
        lines = []
        for s, acts in enumerate(self.actions):
            shown = [a for a in acts if a.type.is_compute] if compute_only else acts
            lines.append(f"stage {s}: " + " ".join(str(a) for a in shown))
        return "\n".join(lines)
