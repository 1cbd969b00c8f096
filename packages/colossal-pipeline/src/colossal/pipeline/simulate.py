"""Replay a schedule with per-action costs: step time, bubble fraction, activations held.

The model matches the executor: sends never block (they are posted and waited for at the end
of the step; posting costs ``send``), a receive waits until its send was posted plus ``comm``
time, and each stage runs its actions strictly in order. Stages may share fewer processors
than there are stages (processor sharing). The bubble fraction is
``1 - busy / (stages x step time)``, where ``busy`` is the total compute time (transfers count
as bubble).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from colossal.pipeline.ir import RECVS, Action, ActionType, ScheduleIR, TimelineEvent

CostFn = Callable[[int, Action], float]


@dataclass(frozen=True)
class ActionCosts:
    """Time of each kind of action on one stage (any unit; seconds when measured).

    Attributes:
        forward: One chunk's forward for one microbatch.
        backward: One chunk's full backward (``B``).
        backward_input: One chunk's input-gradient backward (``I``).
        backward_weight: One chunk's weight-gradient backward (``W``).
        comm: Delay from posting a send to the data being available at the receiver.
        send: Time a stage spends posting one send.
        recv: Time a stage spends posting one receive (before it waits for the data).
    """

    forward: float = 1.0
    backward: float = 2.0
    backward_input: float = 1.0
    backward_weight: float = 1.0
    comm: float = 0.0
    send: float = 0.0
    recv: float = 0.0

    def __post_init__(self) -> None:
        names = ("forward", "backward", "backward_input", "backward_weight", "comm", "send", "recv")
        for name in names:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"ActionCosts.{name} must be a number >= 0, got {value!r}")

    def of(self, action: Action) -> float:
        """Stage time ``action`` takes (for a receive: posting it; the wait comes on top)."""
        return {
            ActionType.FORWARD: self.forward,
            ActionType.BACKWARD: self.backward,
            ActionType.BACKWARD_INPUT: self.backward_input,
            ActionType.BACKWARD_WEIGHT: self.backward_weight,
            ActionType.SEND_FORWARD: self.send,
            ActionType.SEND_BACKWARD: self.send,
            ActionType.RECV_FORWARD: self.recv,
            ActionType.RECV_BACKWARD: self.recv,
        }.get(action.type, 0.0)


@dataclass(frozen=True)
class SimulationResult:
    """What a simulated step looks like.

    Attributes:
        step_time: Time until the last stage finishes.
        bubble_fraction: ``1 - total compute / (stages x step_time)``.
        busy: Compute time per stage.
        peak_activations: Per stage, the most (microbatch, chunk) activations held at once
            (from a forward until its full or weight backward).
        events: Every compute action with its simulated start and end.
    """

    step_time: float
    bubble_fraction: float
    busy: tuple[float, ...]
    peak_activations: tuple[int, ...]
    events: tuple[TimelineEvent, ...] = field(repr=False)


def _cost_fn(costs: ActionCosts | Sequence[ActionCosts] | CostFn, num_stages: int) -> CostFn:
    if isinstance(costs, ActionCosts):
        return lambda stage, action: costs.of(action)
    if callable(costs):
        return costs
    per_stage = list(costs)
    if len(per_stage) != num_stages or not all(isinstance(c, ActionCosts) for c in per_stage):
        raise ValueError(
            f"costs must be ActionCosts, one ActionCosts per stage ({num_stages}), or a "
            f"callable (stage, action) -> float; got {costs!r}"
        )
    return lambda stage, action: per_stage[stage].of(action)


def _comm_fn(
    costs: ActionCosts | Sequence[ActionCosts] | CostFn, comm: float | CostFn | None
) -> CostFn:
    if callable(comm):
        return comm
    if comm is not None:
        return lambda stage, action: comm
    if isinstance(costs, ActionCosts):
        return lambda stage, action: costs.comm
    if callable(costs):
        return lambda stage, action: 0.0
    per_stage = list(costs)
    return lambda stage, action: per_stage[stage].comm


def message_key(ir: ScheduleIR, stage: int, action: Action) -> tuple[str, int, int]:
    """Identity of a transfer's message: ``(kind, microbatch, first slice of the edge)``."""
    v = ir.slice_of(stage, action)
    t = action.type
    if t == ActionType.SEND_FORWARD:
        return ("act", action.microbatch, v)
    if t == ActionType.RECV_FORWARD:
        return ("act", action.microbatch, v - 1)
    if t == ActionType.SEND_BACKWARD:
        return ("grad", action.microbatch, v - 1)
    return ("grad", action.microbatch, v)


def simulate(
    ir: ScheduleIR,
    costs: ActionCosts | Sequence[ActionCosts] | CostFn | None = None,
    comm: float | CostFn | None = None,
    processors: int | None = None,
) -> SimulationResult:
    """Replay ``ir`` with ``costs`` and measure it.

    Args:
        ir: The schedule.
        costs: One :class:`ActionCosts` for all stages, one per stage, or a callable
            ``(stage, action) -> seconds``. Defaults to ``ActionCosts()`` (F=1, B=2, I=W=1).
        comm: Transfer delay overriding the costs' ``comm``: seconds, or a callable
            ``(sending stage, send action) -> seconds`` for per-message delays.
        processors: Processors the stages share (``None``: one each). With fewer processors
            than busy stages, each busy stage runs at ``processors / busy`` speed (processor
            sharing), e.g. 4 CPU processes on 2 cores.

    Returns:
        The step time, bubble fraction, busy time and peak activations per stage, and events.
        Busy time is the wall time of compute actions, stretched when processors are shared.

    Raises:
        ValueError: The schedule deadlocks or receives a message nobody sends (run
            :func:`~colossal.pipeline.validate.validate_schedule` for a detailed report), or
            ``processors`` is not a positive int.
    """
    if processors is not None and (not isinstance(processors, int) or processors < 1):
        raise ValueError(f"processors must be a positive int or None, got {processors!r}")
    costs = ActionCosts() if costs is None else costs
    cost = _cost_fn(costs, ir.num_stages)
    delay = _comm_fn(costs, comm)
    n = ir.num_stages
    pc = [0] * n
    work: list[float | None] = [None] * n  # work left in the running action (compute or send)
    began = [0.0] * n
    wake: list[float | None] = [None] * n  # when a blocked receive's data arrives
    posted = [False] * n  # whether the current receive has been posted
    busy = [0.0] * n
    held = [0] * n
    peak = [0] * n
    sent: dict[tuple[str, int, int], float] = {}
    events: list[TimelineEvent] = []
    t = 0.0

    def eps() -> float:
        return 1e-12 * max(1.0, abs(t))

    def finish(s: int) -> None:
        a = ir.actions[s][pc[s]]
        if a.type in RECVS:  # posted; now it waits for the data (next pass of the loop)
            work[s] = None
            return
        if a.type.is_compute:
            busy[s] += t - began[s]
            events.append(TimelineEvent(s, a, began[s], t))
            if a.type == ActionType.FORWARD:
                held[s] += 1
                peak[s] = max(peak[s], held[s])
            elif a.type in (ActionType.BACKWARD, ActionType.BACKWARD_WEIGHT):
                held[s] -= 1
        else:
            sent[message_key(ir, s, a)] = t + delay(s, a)
        work[s] = None
        pc[s] += 1

    while True:
        moved = True
        while moved:  # run everything that takes no time at ``t``
            moved = False
            for s in range(n):
                acts = ir.actions[s]
                while work[s] is None and pc[s] < len(acts):
                    a = acts[pc[s]]
                    if a.type in RECVS and not posted[s]:
                        posted[s] = True  # posting a receive may take time, then it waits
                        took = cost(s, a)
                        work[s], began[s] = took, t
                        if took > 0:
                            break
                        work[s] = None
                    if a.type in RECVS:
                        arrival = sent.get(message_key(ir, s, a))
                        if arrival is None or arrival > t + eps():
                            wake[s] = arrival
                            break
                        wake[s] = None
                        posted[s] = False
                        pc[s] += 1
                        moved = True
                        continue
                    took = cost(s, a)
                    work[s], began[s] = took, t
                    if took <= 0:
                        finish(s)
                        moved = True
        active = [s for s in range(n) if work[s] is not None]
        waiting = [w for w in wake if w is not None]
        if not active and not waiting:
            break
        rate = 1.0 if processors is None or not active else min(1.0, processors / len(active))
        dt = min([work[s] / rate for s in active] + [w - t for w in waiting])  # type: ignore[operator]
        t += dt
        for s in active:
            work[s] -= dt * rate  # type: ignore[operator]
            if work[s] <= eps():  # type: ignore[operator]
                finish(s)
    stuck = [(s, str(ir.actions[s][pc[s]])) for s in range(n) if pc[s] < len(ir.actions[s])]
    if stuck:
        raise ValueError(f"schedule {ir.name!r} cannot finish; stages wait forever at {stuck}")
    bubble = 1.0 - sum(busy) / (n * t) if t > 0 else 0.0
    return SimulationResult(t, bubble, tuple(busy), tuple(peak), tuple(events))
