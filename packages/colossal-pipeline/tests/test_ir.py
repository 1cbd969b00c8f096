"""Schedule IR, generators, validator, simulator and timelines (no processes needed)."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

from colossal.pipeline import (
    Action,
    ActionCosts,
    ActionType,
    ScheduleIR,
    ScheduleValidationError,
    StageLayout,
    distribute_layers,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    render_text,
    save_png,
    simulate,
    validate_schedule,
    zero_bubble_v,
)
from colossal.pipeline.layout import stage_index

A = ActionType


def _all_schedules(p: int, m: int) -> list[ScheduleIR]:
    irs = [one_f_one_b(p, m), gpipe(p, m), gpipe(p, m, 2), zero_bubble_v(p, m)]
    if m % p == 0:
        irs += [interleaved_1f1b(p, m, 1), interleaved_1f1b(p, m, 2), interleaved_1f1b(p, m, 3)]
    return irs


# ---- layout ------------------------------------------------------------------------------
def test_distribute_layers_gives_remainder_to_the_middle() -> None:
    assert distribute_layers(10, 4) == [2, 3, 3, 2]
    assert distribute_layers(8, 4) == [2, 2, 2, 2]
    assert distribute_layers(9, 4) == [2, 2, 3, 2]
    assert distribute_layers(11, 2, 2) == [2, 3, 3, 3]
    assert sum(distribute_layers(37, 4, 2)) == 37
    with pytest.raises(ValueError, match="cannot split 3 layers"):
        distribute_layers(3, 2, 2)
    with pytest.raises(ValueError, match="num_stages"):
        distribute_layers(3, 0)


def test_slice_placement_loop_and_v() -> None:
    loop = StageLayout(4, 2, "loop")
    assert [loop.slice_of(1, c) for c in range(2)] == [1, 5]
    v = StageLayout(4, 2, "v")
    assert [v.slice_of(s, 1) for s in range(4)] == [7, 6, 5, 4]
    assert v.loss_stage() == 0 and loop.loss_stage() == 3
    for lay in (loop, v):
        assert all(lay.slice_of(*lay.locate(i)) == i for i in range(lay.num_slices))
    counts = [1, 2, 3, 4, 5, 6, 7, 8]
    assert stage_index(counts, 1, loop) == [(1, 3), (15, 21)]
    assert stage_index(counts, 1, v) == [(1, 3), (21, 28)]
    with pytest.raises(ValueError, match="V layout holds exactly 2"):
        StageLayout(4, 3, "v")
    with pytest.raises(ValueError, match="needs 8"):
        stage_index([1, 2], 0, loop)


# ---- generators and validator ------------------------------------------------------------
@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 12])
def test_generated_schedules_validate(p: int, m: int) -> None:
    for ir in _all_schedules(p, m):
        validate_schedule(ir)
        # every (microbatch, slice) forwards exactly once
        forwards = sum(a.type == A.FORWARD for acts in ir.actions for a in acts)
        assert forwards == m * ir.layout.num_slices, ir.name


def test_1f1b_is_deadlock_free_even_with_rendezvous_sends() -> None:
    validate_schedule(one_f_one_b(4, 8), blocking_sends=True)


def _replace(ir: ScheduleIR, stage: int, actions: list[Action]) -> ScheduleIR:
    acts = list(ir.actions)
    acts[stage] = tuple(actions)
    return dataclasses.replace(ir, actions=tuple(acts))


def test_validator_rejects_planted_deadlock() -> None:
    ir = one_f_one_b(2, 2)
    acts = list(ir.actions[0])
    recv = Action(A.RECV_BACKWARD, 0)
    acts.remove(recv)
    acts.insert(0, recv)  # stage 0 waits for mb 0's gradient before computing mb 0
    with pytest.raises(ScheduleValidationError, match="deadlocks.*stage 0 waits at RB0.0"):
        validate_schedule(_replace(ir, 0, acts))


def test_validator_rejects_cross_stage_cycle() -> None:
    # Both stages first receive from each other, then send: a cycle of two receives.
    ir = gpipe(2, 1, 2)
    s0 = [a for a in ir.actions[0] if a.type != A.SEND_FORWARD or a.chunk != 0]
    s0.insert(s0.index(Action(A.FORWARD, 0, 1)) + 1, Action(A.SEND_FORWARD, 0, 0))
    with pytest.raises(ScheduleValidationError, match="deadlocks"):
        validate_schedule(_replace(ir, 0, s0))


def test_validator_rejects_unmatched_misordered_and_incomplete() -> None:
    ir = one_f_one_b(2, 2)
    no_recv = [a for a in ir.actions[1] if a != Action(A.RECV_FORWARD, 1)]
    with pytest.raises(ScheduleValidationError, match="receives"):
        validate_schedule(_replace(ir, 1, no_recv))
    fifo = gpipe(2, 2)
    swapped = list(fifo.actions[1])
    i, j = swapped.index(Action(A.RECV_FORWARD, 0)), swapped.index(Action(A.RECV_FORWARD, 1))
    fwd0, fwd1 = swapped.index(Action(A.FORWARD, 0)), swapped.index(Action(A.FORWARD, 1))
    swapped[i], swapped[j] = swapped[j], swapped[i]
    swapped[fwd0], swapped[fwd1] = swapped[fwd1], swapped[fwd0]
    with pytest.raises(ScheduleValidationError, match="received in order"):
        validate_schedule(_replace(fifo, 1, swapped))
    no_backward = [a for a in ir.actions[0] if a != Action(A.BACKWARD, 1)]
    with pytest.raises(ScheduleValidationError, match="never runs the backward"):
        validate_schedule(_replace(ir, 0, no_backward))
    early = [Action(A.SEND_FORWARD, 0)] + [
        a for a in ir.actions[0] if a != Action(A.SEND_FORWARD, 0)
    ]
    with pytest.raises(ScheduleValidationError, match="before computing"):
        validate_schedule(_replace(ir, 0, early))


def test_interleaved_rejects_microbatches_not_multiple_of_stages() -> None:
    with pytest.raises(ValueError, match="multiple of"):
        interleaved_1f1b(4, 6, 2)


# ---- simulator ---------------------------------------------------------------------------
@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("m", [4, 8, 16])
def test_bubble_fraction_formulas(p: int, m: int) -> None:
    one = simulate(one_f_one_b(p, m), ActionCosts(forward=1, backward=2))
    assert one.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert one.step_time == pytest.approx(3 * (m + p - 1))
    assert one.peak_activations == tuple(min(p - s, m) for s in range(p))
    assert simulate(gpipe(p, m)).bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    # interleaving v chunks (each 1/v of the work) divides the bubble by v
    v = 2
    inter = simulate(interleaved_1f1b(p, m, v), ActionCosts(forward=1 / v, backward=2 / v))
    assert inter.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    assert inter.bubble_fraction < one.bubble_fraction
    zbv = simulate(
        zero_bubble_v(p, m), ActionCosts(forward=0.5, backward_input=0.5, backward_weight=0.5)
    )
    assert zbv.bubble_fraction < inter.bubble_fraction
    if m >= 2 * p:
        # only the ramp-up remains: the step is the ideal 3m plus p-1 chunk forwards (0.5 each)
        ramp = 0.5 * (p - 1)
        assert zbv.bubble_fraction <= ramp / (3 * m + ramp) + 1e-9
        assert zbv.bubble_fraction < 0.07
    assert max(zbv.peak_activations) <= 2 * p  # same memory as 1F1B's first stage
    assert sum(zbv.busy) == pytest.approx(p * 3 * m)


def test_simulator_uses_per_stage_costs_and_comm_delay() -> None:
    ir = one_f_one_b(2, 4)
    fast = simulate(ir, ActionCosts(forward=1, backward=2))
    slow_last = simulate(ir, [ActionCosts(1, 2), ActionCosts(2, 4)])
    assert slow_last.step_time > fast.step_time
    delayed = simulate(ir, ActionCosts(forward=1, backward=2, comm=0.5))
    # at least the first forward and the last backward cross the link on the critical path
    assert delayed.step_time >= fast.step_time + 2 * 0.5
    assert delayed.busy == fast.busy
    assert simulate(ir, lambda stage, action: 1.0).busy == (8.0, 8.0)
    with pytest.raises(ValueError, match="one ActionCosts per stage"):
        simulate(ir, [ActionCosts()])
    with pytest.raises(ValueError, match="must be a number >= 0"):
        ActionCosts(forward=-1)


def test_simulator_processor_sharing_and_receive_posting() -> None:
    ir = one_f_one_b(4, 8)
    alone = simulate(ir)
    one_cpu = simulate(ir, processors=1)
    assert one_cpu.step_time == pytest.approx(4 * 8 * 3)  # all work, one processor, no idling
    two = simulate(ir, processors=2)
    assert 4 * 8 * 3 / 2 <= two.step_time <= one_cpu.step_time
    assert simulate(ir, processors=8).step_time == pytest.approx(alone.step_time)
    posting = simulate(ir, ActionCosts(forward=1, backward=2, recv=0.25, send=0.25))
    assert posting.step_time > alone.step_time and posting.busy == alone.busy
    with pytest.raises(ValueError, match="processors must be a positive int"):
        simulate(ir, processors=0)


def test_timeline_text_and_png_degrades_without_matplotlib(tmp_path) -> None:
    result = simulate(one_f_one_b(4, 4))
    text = render_text(result.events, width=40)
    lines = text.splitlines()
    assert len(lines) == 4 and all(len(line.split("|")[1]) == 40 for line in lines)
    assert lines[3].split("|")[1].startswith(".....F")  # the last stage idles 3 of 21 units
    zbv_text = render_text(simulate(zero_bubble_v(2, 4)).events)
    assert "i" in zbv_text and "W" in zbv_text
    target = tmp_path / "timeline.png"
    if importlib.util.find_spec("matplotlib") is None:
        with pytest.warns(RuntimeWarning, match="pip install 'colossal-pipeline\\[plot\\]'"):
            assert save_png(result.events, target) is None
        assert not target.exists()
    else:
        assert save_png(result.events, target, title="1f1b") == target
        assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no timeline events"):
        render_text([])
