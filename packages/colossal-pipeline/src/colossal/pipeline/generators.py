"""Generators of schedule IR: GPipe, 1F1B, interleaved 1F1B and zero-bubble V.

Each generator decides the order of compute actions per stage; :func:`insert_comm` then adds a
receive right before every compute whose input lives on another stage and a send right after
every compute whose output is needed on another stage. Consecutive transfers are posted
together by the executor, so a stage's "send forward, receive backward" pair is one batch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from colossal.pipeline.ir import Action, ActionType, ScheduleIR
from colossal.pipeline.layout import StageLayout
from colossal.pipeline.simulate import ActionCosts

F, B = ActionType.FORWARD, ActionType.BACKWARD
I, W = ActionType.BACKWARD_INPUT, ActionType.BACKWARD_WEIGHT  # noqa: E741 - the paper's names


def _check(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def insert_comm(
    layout: StageLayout, compute: Sequence[Sequence[Action]]
) -> tuple[tuple[Action, ...], ...]:
    """Add the transfers that each stage's compute actions need, in place around them."""
    last = layout.num_slices - 1
    out_all = []
    for s, acts in enumerate(compute):
        out: list[Action] = []
        for a in acts:
            v = layout.slice_of(s, a.chunk)
            prev_remote = v > 0 and layout.locate(v - 1)[0] != s
            next_remote = v < last and layout.locate(v + 1)[0] != s
            mb, c = a.microbatch, a.chunk
            if a.type == F:
                if prev_remote:
                    out.append(Action(ActionType.RECV_FORWARD, mb, c))
                out.append(a)
                if next_remote:
                    out.append(Action(ActionType.SEND_FORWARD, mb, c))
            elif a.type in (B, I):
                if next_remote:
                    out.append(Action(ActionType.RECV_BACKWARD, mb, c))
                out.append(a)
                if prev_remote:
                    out.append(Action(ActionType.SEND_BACKWARD, mb, c))
            else:
                out.append(a)
        out_all.append(tuple(out))
    return tuple(out_all)


def forward_only(layout: StageLayout, num_microbatches: int, name: str = "forward") -> ScheduleIR:
    """Forwards only, for evaluation (GPipe's first half, on a loop or V layout).

    Each stage runs its chunks in slice order, every microbatch of one chunk before the next.
    """
    _check("num_microbatches", num_microbatches)
    compute = [
        [Action(F, mb, c) for c in range(layout.num_chunks) for mb in range(num_microbatches)]
        for _ in range(layout.num_stages)
    ]
    return ScheduleIR(name, layout, num_microbatches, insert_comm(layout, compute))


def gpipe(num_stages: int, num_microbatches: int, num_chunks: int = 1) -> ScheduleIR:
    """All forwards, then all backwards (chunks in the loop layout, the last chunk first back)."""
    _check("num_stages", num_stages)
    _check("num_microbatches", num_microbatches)
    layout = StageLayout(num_stages, num_chunks, "loop")
    compute = []
    for _ in range(num_stages):
        acts = [Action(F, mb, c) for c in range(num_chunks) for mb in range(num_microbatches)]
        acts += [
            Action(B, mb, c) for c in reversed(range(num_chunks)) for mb in range(num_microbatches)
        ]
        compute.append(acts)
    return ScheduleIR("gpipe", layout, num_microbatches, insert_comm(layout, compute))


def one_f_one_b(num_stages: int, num_microbatches: int) -> ScheduleIR:
    """1F1B: ``S - s - 1`` warm-up forwards on stage ``s``, then one forward one backward."""
    _check("num_stages", num_stages)
    _check("num_microbatches", num_microbatches)
    layout = StageLayout(num_stages, 1, "loop")
    compute = []
    for s in range(num_stages):
        warmup = min(num_stages - s - 1, num_microbatches)
        acts = [Action(F, mb) for mb in range(warmup)]
        for k in range(num_microbatches - warmup):
            acts += [Action(F, warmup + k), Action(B, k)]
        acts += [Action(B, mb) for mb in range(num_microbatches - warmup, num_microbatches)]
        compute.append(acts)
    return ScheduleIR("1f1b", layout, num_microbatches, insert_comm(layout, compute))


def interleaved_1f1b(num_stages: int, num_microbatches: int, num_chunks: int) -> ScheduleIR:
    """Megatron's interleaved 1F1B over ``num_chunks`` chunks per stage (loop layout).

    Microbatches go through the chunks in groups of ``S``; stage ``s`` warms up with
    ``2 (S - s - 1) + (C - 1) S`` forwards (``S - s - 1`` when ``C == 1``).

    Raises:
        ValueError: ``num_microbatches`` is not a multiple of ``num_stages``.
    """
    _check("num_stages", num_stages)
    _check("num_microbatches", num_microbatches)
    _check("num_chunks", num_chunks)
    if num_microbatches % num_stages:
        raise ValueError(
            f"interleaved 1F1B needs num_microbatches ({num_microbatches}) to be a multiple of "
            f"the number of stages ({num_stages}); use e.g. "
            f"{num_stages * -(-num_microbatches // num_stages)}"
        )
    layout = StageLayout(num_stages, num_chunks, "loop")
    S, C, M = num_stages, num_chunks, num_microbatches  # noqa: N806 - the paper's names
    total = M * C

    def chunk_mb(k: int, forward: bool) -> tuple[int, int]:
        group, r = divmod(k, S * C)
        chunk = r // S
        return (chunk if forward else C - 1 - chunk), group * S + r % S

    compute = []
    for s in range(S):
        warmup = (S - s - 1) if C == 1 else 2 * (S - s - 1) + (C - 1) * S
        warmup = min(warmup, total)
        acts = []
        for k in range(warmup):
            c, mb = chunk_mb(k, True)
            acts.append(Action(F, mb, c))
        for k in range(total - warmup):
            c, mb = chunk_mb(warmup + k, True)
            acts.append(Action(F, mb, c))
            c, mb = chunk_mb(k, False)
            acts.append(Action(B, mb, c))
        for k in range(total - warmup, total):
            c, mb = chunk_mb(k, False)
            acts.append(Action(B, mb, c))
        compute.append(acts)
    return ScheduleIR("interleaved", layout, num_microbatches, insert_comm(layout, compute))


def zero_bubble_v(
    num_stages: int,
    num_microbatches: int,
    costs: ActionCosts | None = None,
    max_in_flight: int | None = None,
) -> ScheduleIR:
    """Zero-bubble V (ZB-V): two chunks per stage in a V, backward split into I and W.

    The order comes from a greedy list scheduler run on ``costs``: whenever a stage is free
    it runs the ready input-gradient backward of the oldest microbatch, else the ready forward
    of the oldest microbatch (while it holds fewer than ``max_in_flight`` activations), else a
    deferred weight-gradient backward, which fills what would otherwise be bubbles.

    Args:
        num_stages: Pipeline stages ``S``.
        num_microbatches: Microbatches ``M``.
        costs: Costs of F, I and W per chunk and the transfer delay (uniform by default).
        max_in_flight: Activations (microbatch x chunk) a stage may hold; ``2 S`` by default,
            the same memory as 1F1B's first stage.
    """
    _check("num_stages", num_stages)
    _check("num_microbatches", num_microbatches)
    costs = costs or ActionCosts(forward=1.0, backward_input=1.0, backward_weight=1.0)
    limit = 2 * num_stages if max_in_flight is None else max_in_flight
    _check("max_in_flight", limit)
    layout = StageLayout(num_stages, 2, "v")
    S, M, V = num_stages, num_microbatches, layout.num_slices  # noqa: N806
    f_end: dict[tuple[int, int], float] = {}
    i_end: dict[tuple[int, int], float] = {}
    next_f = [[0, 0] for _ in range(S)]
    next_i = [[0, 0] for _ in range(S)]
    pending_w: list[deque[tuple[Action, float]]] = [deque() for _ in range(S)]
    held = [0] * S
    free = [0.0] * S
    order: list[list[Action]] = [[] for _ in range(S)]

    def arrival(end: float, src_stage: int, dst_stage: int) -> float:
        return end + (costs.comm if src_stage != dst_stage else 0.0)

    def candidates(s: int) -> list[tuple[int, float, tuple[int, int], Action]]:
        out = []
        for c in (0, 1):
            v = layout.slice_of(s, c)
            mb = next_i[s][c]
            if mb < M and (mb, v) in f_end:
                if v == V - 1:
                    out.append((0, f_end[mb, v], (mb, -v), Action(I, mb, c)))
                elif (mb, v + 1) in i_end:
                    ready = arrival(i_end[mb, v + 1], layout.locate(v + 1)[0], s)
                    out.append((0, max(ready, f_end[mb, v]), (mb, -v), Action(I, mb, c)))
            mb = next_f[s][c]
            # The V's way down (chunk 0) leaves one activation free for its way up: filled
            # with chunk-0 forwards (a transfer delay makes them ready first), no stage could
            # start a chunk-1 forward, so no backward, so no weight backward freeing one.
            if mb < M and held[s] < limit - (1 if c == 0 and limit > 1 else 0):
                if v == 0:
                    out.append((1, 0.0, (mb, -v), Action(F, mb, c)))
                elif (mb, v - 1) in f_end:
                    ready = arrival(f_end[mb, v - 1], layout.locate(v - 1)[0], s)
                    out.append((1, ready, (mb, -v), Action(F, mb, c)))
        if pending_w[s]:
            action, ready = pending_w[s][0]
            out.append((2, ready, (0, 0), action))
        return out

    remaining = 6 * M * S
    while remaining:
        best: tuple[float, int, Action] | None = None
        for s in range(S):
            cands = candidates(s)
            if not cands:
                continue
            start = max(free[s], min(c[1] for c in cands))
            ready = [c for c in cands if c[1] <= start]
            _, _, _, action = min(ready, key=lambda c: (c[0], c[2]))
            if best is None or start < best[0]:
                best = (start, s, action)
        if best is None:
            raise RuntimeError("zero-bubble V scheduler is stuck; raise max_in_flight")
        start, s, a = best
        v = layout.slice_of(s, a.chunk)
        if a.type == F:
            end = start + costs.forward
            f_end[a.microbatch, v] = end
            next_f[s][a.chunk] += 1
            held[s] += 1
        elif a.type == I:
            end = start + costs.backward_input
            i_end[a.microbatch, v] = end
            next_i[s][a.chunk] += 1
            pending_w[s].append((Action(W, a.microbatch, a.chunk), end))
        else:
            end = start + costs.backward_weight
            pending_w[s].popleft()
            held[s] -= 1
        free[s] = end
        order[s].append(a)
        remaining -= 1
    return ScheduleIR("zbv", layout, num_microbatches, insert_comm(layout, order))
