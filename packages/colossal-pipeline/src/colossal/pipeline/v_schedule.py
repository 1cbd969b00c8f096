"""ColossalAI's ZB-V graph builder: ``PipelineGraph(...).get_v_schedule()`` on our scheduler.

ColossalAI builds a zero-bubble V schedule from the costs of a chunk's forward (``f_cost``),
input-gradient backward (``b_cost``), weight-gradient backward (``w_cost``) and a transfer
(``c_cost``), under a memory limit, and hands ``ZeroBubbleVPipeScheduler(schedule=...)`` one
list of :class:`ScheduledNode` per stage. Here the order comes from
:func:`colossal.pipeline.generators.zero_bubble_v` (a greedy list scheduler on the same
costs) and the times from :func:`colossal.pipeline.simulate.simulate`; the costs default to
the simulator's uniform ones, so a user need not measure anything. ColossalAI's ``"B"`` node is
our input-gradient backward (``I``).

Memory: ColossalAI charges ``f_mem`` per forward and releases it with ``b_mem + w_mem``; the
scheduler here limits the activations a stage holds (from a forward to its weight backward)
to ``max_mem // f_mem`` (default ``2 x n_stage``, 1F1B's first stage).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from colossal.pipeline.generators import insert_comm, zero_bubble_v
from colossal.pipeline.ir import Action, ActionType, ScheduleIR
from colossal.pipeline.layout import StageLayout
from colossal.pipeline.simulate import ActionCosts, simulate

__all__ = ["PipelineGraph", "ScheduledNode", "nodes_to_ir"]

_TO_NODE = {
    ActionType.FORWARD: "F",
    ActionType.BACKWARD_INPUT: "B",
    ActionType.BACKWARD_WEIGHT: "W",
    ActionType.SEND_FORWARD: "SEND_FORWARD",
    ActionType.RECV_FORWARD: "RECV_FORWARD",
    ActionType.SEND_BACKWARD: "SEND_BACKWARD",
    ActionType.RECV_BACKWARD: "RECV_BACKWARD",
}
_COMPUTE = {
    "F": ActionType.FORWARD,
    "B": ActionType.BACKWARD_INPUT,
    "W": ActionType.BACKWARD_WEIGHT,
}


@dataclass(frozen=True)
class ScheduledNode:
    """One action of one stage, as ColossalAI's ``ScheduledNode``.

    Attributes:
        type: ``"F"``, ``"B"`` (input gradient), ``"W"`` (weight gradient) or a transfer
            (``"SEND_FORWARD"``, ``"RECV_FORWARD"``, ``"SEND_BACKWARD"``, ``"RECV_BACKWARD"``).
        chunk: The stage's model chunk (0: the V's way down, 1: its way up).
        stage: The pipeline stage.
        minibatch: The microbatch.
        start_time: Simulated start (cost units).
        completion_time: Simulated end.
    """

    type: str
    chunk: int
    stage: int
    minibatch: int
    start_time: float = 0.0
    completion_time: float = 0.0


def _positive_int(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"PipelineGraph: {name}={value!r} must be a positive int")
    return value


def _cost(name: str, value: float, allow_zero: bool = False) -> float:
    number = float(value)
    if number < 0 or (number == 0 and not allow_zero):
        least = "at least 0" if allow_zero else "positive"
        raise ValueError(f"PipelineGraph: {name}={value!r} must be {least}")
    return number


class PipelineGraph:
    """Builds a ZB-V schedule for ``n_stage`` stages and ``n_micro`` microbatches.

    Args:
        n_stage: Pipeline stages.
        n_micro: Microbatches per step.
        f_cost: A chunk's forward time (any unit).
        b_cost: A chunk's input-gradient backward time.
        w_cost: A chunk's weight-gradient backward time.
        c_cost: A transfer's delay between stages (0 allowed).
        f_mem: Memory a forward keeps (only its ratio to ``max_mem`` is used).
        b_mem: Memory an input backward frees (ColossalAI's; not used: W frees it all here).
        w_mem: Memory a weight backward frees (likewise).
        max_mem: A stage's memory limit; ``max_mem // f_mem`` activations at once
            (``2 x n_stage`` when None).

    Raises:
        ValueError: A size is not a positive int, a cost is negative (or zero for F, B, W),
            ``f_mem`` is not positive, or ``max_mem`` leaves room for no activation.
    """

    def __init__(
        self,
        n_stage: int,
        n_micro: int,
        f_cost: float = 1.0,
        b_cost: float = 1.0,
        w_cost: float = 1.0,
        c_cost: float = 0.0,
        f_mem: float = 1.0,
        b_mem: float = 0.0,
        w_mem: float = -1.0,
        max_mem: float | None = None,
    ) -> None:
        self.n_stage = _positive_int("n_stage", n_stage)
        self.n_micro = _positive_int("n_micro", n_micro)
        self.costs = ActionCosts(
            forward=_cost("f_cost", f_cost),
            backward=_cost("b_cost", b_cost) + _cost("w_cost", w_cost),
            backward_input=_cost("b_cost", b_cost),
            backward_weight=_cost("w_cost", w_cost),
            comm=_cost("c_cost", c_cost, allow_zero=True),
        )
        self.f_mem, self.b_mem, self.w_mem = float(f_mem), float(b_mem), float(w_mem)
        if self.f_mem <= 0:
            raise ValueError(f"PipelineGraph: f_mem={f_mem!r} must be positive")
        self.max_mem = 2 * self.n_stage * self.f_mem if max_mem is None else float(max_mem)
        self.max_in_flight = int(self.max_mem // self.f_mem)
        if self.max_in_flight < 1:
            raise ValueError(
                f"PipelineGraph: max_mem={max_mem!r} holds no forward of f_mem={f_mem!r}; "
                "raise max_mem to at least f_mem"
            )

    @classmethod
    def from_costs(
        cls, n_stage: int, n_micro: int, costs: ActionCosts, max_in_flight: int | None = None
    ) -> PipelineGraph:
        """A graph from the simulator's :class:`ActionCosts` (e.g. measured ones)."""
        limit = 2 * n_stage if max_in_flight is None else max_in_flight
        return cls(
            n_stage,
            n_micro,
            costs.forward,
            costs.backward_input,
            costs.backward_weight,
            costs.comm,
            max_mem=float(_positive_int("max_in_flight", limit)),
        )

    def get_ir(self) -> ScheduleIR:
        """The schedule as Colossal's IR (what :class:`ZeroBubbleVPipeScheduler` runs)."""
        return zero_bubble_v(self.n_stage, self.n_micro, self.costs, self.max_in_flight)

    def get_v_schedule(self, only_run_time: bool = False) -> list[list[ScheduledNode]] | float:
        """Per stage, its nodes in order (transfers included), timed by the simulator.

        Args:
            only_run_time: Return only the simulated step time (ColossalAI's argument).
        """
        ir = self.get_ir()
        result = simulate(ir, self.costs)
        if only_run_time:
            return result.step_time
        times = {(e.stage, e.action): (e.start, e.end) for e in result.events}
        nodes: list[list[ScheduledNode]] = []
        for stage, actions in enumerate(ir.actions):
            row: list[ScheduledNode] = []
            last = 0.0
            for action in actions:
                start, end = times.get((stage, action), (last, last))
                last = end
                row.append(
                    ScheduledNode(
                        _TO_NODE[action.type], action.chunk, stage, action.microbatch, start, end
                    )
                )
            nodes.append(row)
        return nodes


def nodes_to_ir(nodes: Sequence[Sequence[ScheduledNode]], name: str = "zbv") -> ScheduleIR:
    """The IR of a ZB-V node schedule (ColossalAI's ``get_v_schedule()`` result, or ours).

    Only the compute nodes' order is taken; the transfers are placed as our executor needs
    them (:func:`colossal.pipeline.generators.insert_comm`).

    Raises:
        ValueError: A node of an unknown type or of another stage than its list's, or
            microbatches that are not ``0 .. M - 1``.
    """
    stages = len(nodes)
    if stages < 1:
        raise ValueError("a node schedule needs one list of nodes per stage, got none")
    order: list[list[Action]] = []
    micro: set[int] = set()
    for stage, row in enumerate(nodes):
        actions = []
        for node in row:
            if node.stage != stage:
                raise ValueError(f"node {node} is in the list of stage {stage}")
            if node.type in _COMPUTE:
                actions.append(Action(_COMPUTE[node.type], node.minibatch, node.chunk))
                micro.add(node.minibatch)
            elif node.type not in _TO_NODE.values():
                raise ValueError(
                    f"unknown node type {node.type!r}; expected F, B, W or a SEND_/RECV_ node"
                )
        order.append(actions)
    count = len(micro)
    if micro != set(range(count)):
        raise ValueError(f"the nodes' microbatches {sorted(micro)} are not 0 .. {count - 1}")
    layout = StageLayout(stages, 2, "v")
    return ScheduleIR(name, layout, count, insert_comm(layout, order))
