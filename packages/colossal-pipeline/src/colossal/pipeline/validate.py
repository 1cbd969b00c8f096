"""Prove a schedule IR correct before running it: complete, matched, ordered, deadlock-free.

The deadlock check replays every stage's action list under the executor's rules: consecutive
transfers of a stage form one batch, posted together; a batch completes once every receive in
it has its matching send posted (and, with ``blocking_sends=True``, every send in it has its
matching receive posted, the stricter rendezvous model). A stage moves on only when its batch
completes. If no stage can move and some have actions left, the schedule deadlocks.
"""

from __future__ import annotations

from collections import defaultdict

from colossal.pipeline.ir import COMPUTE, RECVS, SENDS, Action, ActionType, ScheduleIR
from colossal.pipeline.simulate import message_key

F, B = ActionType.FORWARD, ActionType.BACKWARD
I, W = ActionType.BACKWARD_INPUT, ActionType.BACKWARD_WEIGHT  # noqa: E741


class ScheduleValidationError(ValueError):
    """A schedule IR is incomplete, mismatched, mis-ordered or can deadlock."""


def _index(ir: ScheduleIR, stage: int) -> dict[Action, int]:
    pos: dict[Action, int] = {}
    for i, a in enumerate(ir.actions[stage]):
        if a in pos:
            raise ScheduleValidationError(
                f"stage {stage} runs {a} twice (positions {pos[a]} and {i})"
            )
        if a.microbatch >= ir.num_microbatches or a.chunk >= ir.num_chunks:
            raise ScheduleValidationError(
                f"stage {stage}: {a} is outside {ir.num_microbatches} microbatches x "
                f"{ir.num_chunks} chunks"
            )
        pos[a] = i
    return pos


def _check_compute(ir: ScheduleIR, pos: list[dict[Action, int]]) -> None:
    layout = ir.layout
    last = layout.num_slices - 1
    for v in range(layout.num_slices):
        s, c = layout.locate(v)
        p = pos[s]
        for mb in range(ir.num_microbatches):
            f, b = Action(F, mb, c), Action(B, mb, c)
            i, w = Action(I, mb, c), Action(W, mb, c)
            if f not in p:
                raise ScheduleValidationError(f"stage {s} never runs forward {f}")
            split = i in p or w in p
            if split and b in p:
                raise ScheduleValidationError(f"stage {s} runs both {b} and the split {i}/{w}")
            if split and not (i in p and w in p):
                raise ScheduleValidationError(
                    f"stage {s} runs only half of the split backward {i}/{w}"
                )
            if not split and b not in p:
                raise ScheduleValidationError(f"stage {s} never runs the backward of {f}")
            grad = i if split else b
            if p[grad] < p[f]:
                raise ScheduleValidationError(f"stage {s} runs {grad} before its forward {f}")
            if split and p[w] < p[i]:
                raise ScheduleValidationError(f"stage {s} runs {w} before {i}")
            # a neighbour slice on the same stage hands over locally: order must follow it
            if v > 0 and layout.locate(v - 1)[0] == s:
                before = Action(F, mb, layout.locate(v - 1)[1])
                if p.get(before, len(p)) > p[f]:
                    raise ScheduleValidationError(f"stage {s} runs {f} before its input {before}")
            if v < last and layout.locate(v + 1)[0] == s:
                c2 = layout.locate(v + 1)[1]
                after = Action(I, mb, c2) if Action(I, mb, c2) in p else Action(B, mb, c2)
                if p.get(after, len(p)) > p[grad]:
                    raise ScheduleValidationError(f"stage {s} runs {grad} before {after}")


def _check_transfers(ir: ScheduleIR, pos: list[dict[Action, int]]) -> None:
    sends: dict[tuple, tuple[int, Action]] = {}
    recvs: dict[tuple, tuple[int, Action]] = {}
    order: dict[tuple[str, int, int], dict[str, list[int]]] = defaultdict(
        lambda: {"send": [], "recv": []}
    )
    for s, acts in enumerate(ir.actions):
        for a in acts:
            if a.type in COMPUTE:
                continue
            v = ir.slice_of(s, a)
            fwd = a.type in (ActionType.SEND_FORWARD, ActionType.RECV_FORWARD)
            other = (
                v + 1 if a.type in (ActionType.SEND_FORWARD, ActionType.RECV_BACKWARD) else v - 1
            )
            if not 0 <= other < ir.layout.num_slices or ir.layout.locate(other)[0] == s:
                raise ScheduleValidationError(f"stage {s}: {a} has no remote peer (slice {other})")
            key = message_key(ir, s, a)
            book = sends if a.type in SENDS else recvs
            if key in book:
                raise ScheduleValidationError(
                    f"stage {s}: {a} duplicates {book[key][1]} on stage {book[key][0]}"
                )
            book[key] = (s, a)
            order[(key[0], key[2], 0)]["send" if a.type in SENDS else "recv"].append(a.microbatch)
            # ordering against the compute that produces or consumes the message
            p = pos[s]
            split = Action(I, a.microbatch, a.chunk) in p
            grad = Action(I if split else B, a.microbatch, a.chunk)
            compute = Action(F, a.microbatch, a.chunk) if fwd else grad
            if compute not in p:
                raise ScheduleValidationError(f"stage {s}: {a} has no matching compute {compute}")
            produced = a.type in SENDS
            if produced and p[a] < p[compute]:
                raise ScheduleValidationError(
                    f"stage {s} sends {a} before computing it ({compute})"
                )
            if not produced and p[a] > p[compute]:
                raise ScheduleValidationError(
                    f"stage {s} receives {a} after it is needed by {compute}"
                )
    for key in sorted(set(sends) | set(recvs)):
        if key not in recvs:
            s, a = sends[key]
            raise ScheduleValidationError(f"stage {s} sends {a} but no stage receives it")
        if key not in sends:
            s, a = recvs[key]
            raise ScheduleValidationError(f"stage {s} receives {a} but no stage sends it")
    for (kind, edge, _), seq in order.items():
        if seq["send"] != seq["recv"]:
            raise ScheduleValidationError(
                f"{kind} messages across slices {edge}->{edge + 1} are sent in microbatch order "
                f"{seq['send']} but received in order {seq['recv']}; transfers on one channel "
                "must be received in the order they are sent"
            )
    needed = _needed_transfers(ir)
    if needed != set(sends):
        missing = sorted(needed - set(sends))
        raise ScheduleValidationError(f"transfers missing from the schedule: {missing[:5]}")


def _needed_transfers(ir: ScheduleIR) -> set[tuple[str, int, int]]:
    layout = ir.layout
    out = set()
    for v in range(layout.num_slices - 1):
        if layout.locate(v)[0] != layout.locate(v + 1)[0]:
            for mb in range(ir.num_microbatches):
                out.add(("act", mb, v))
                out.add(("grad", mb, v))
    return out


def _check_deadlock(ir: ScheduleIR, blocking_sends: bool) -> None:
    n = ir.num_stages
    pc = [0] * n
    posted_sends: set[tuple] = set()
    posted_recvs: set[tuple] = set()
    progress = True
    while progress:
        progress = False
        for s in range(n):
            acts = ir.actions[s]
            while pc[s] < len(acts):
                if acts[pc[s]].type in COMPUTE:
                    pc[s] += 1
                    progress = True
                    continue
                end = pc[s]
                while end < len(acts) and acts[end].type not in COMPUTE:
                    end += 1
                batch = acts[pc[s] : end]
                for a in batch:
                    (posted_sends if a.type in SENDS else posted_recvs).add(message_key(ir, s, a))
                done = all(
                    message_key(ir, s, a) in posted_sends for a in batch if a.type in RECVS
                ) and (
                    not blocking_sends
                    or all(message_key(ir, s, a) in posted_recvs for a in batch if a.type in SENDS)
                )
                if not done:
                    break
                pc[s] = end
                progress = True
    stuck = {s: ir.actions[s][pc[s]] for s in range(n) if pc[s] < len(ir.actions[s])}
    if stuck:
        waits = "; ".join(f"stage {s} waits at {a} (action {pc[s]})" for s, a in stuck.items())
        model = "rendezvous sends" if blocking_sends else "asynchronous sends"
        raise ScheduleValidationError(f"schedule {ir.name!r} deadlocks under {model}: {waits}")


def validate_schedule(ir: ScheduleIR, blocking_sends: bool = False) -> None:
    """Check that ``ir`` computes every (microbatch, slice) once, in a valid order, and can finish.

    Checks: every slice runs one forward and one backward (or one input and one weight
    backward) per microbatch, after its inputs; every transfer between stages has exactly
    one matching send and receive, in the same microbatch order on each channel, each after
    the compute producing it and before the compute consuming it; and the global order cannot
    deadlock (see the module docstring).

    Args:
        ir: The schedule.
        blocking_sends: Also require freedom from deadlock when sends block until received.

    Raises:
        ScheduleValidationError: The first problem found, naming the stage and action.
    """
    pos = [_index(ir, s) for s in range(ir.num_stages)]
    _check_compute(ir, pos)
    _check_transfers(ir, pos)
    _check_deadlock(ir, blocking_sends)
