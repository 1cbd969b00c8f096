"""Pytree transfers: values round-trip, metadata goes once and again only when it changes."""

from __future__ import annotations

import pytest
import torch
from helpers import Block, make_stage_manager, mse_to_flipped, split_model
from torch import nn

from colossal.core import ProcessGroupMesh
from colossal.core.comm import CommTracker
from colossal.core.testing import distributed_test
from colossal.pipeline import OneForwardOneBackwardSchedule, PipelineP2P
from colossal.pipeline.tree import flatten, unflatten


def _tree(scale: float, rows: int = 3) -> dict:
    return {
        "h": torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4) * scale,
        "mask": torch.tensor([True, False, True]),
        "ids": torch.arange(5, dtype=torch.int64),
        "half": torch.full((2, 3), scale, dtype=torch.bfloat16),
        "extra": [torch.tensor(scale), torch.empty(0, 7), (1, "text", None)],
    }


def _same(a, b) -> bool:
    ta, sa = flatten(a)
    tb, sb = flatten(b)
    return sa == sb and all(
        x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(ta, tb, strict=True)
    )


def test_tree_round_trip_and_rejects_objects() -> None:
    tree = _tree(2.0)
    tensors, spec = flatten(tree)
    assert len(tensors) == 6
    assert _same(unflatten(tensors, spec), tree)
    with pytest.raises(TypeError, match="cannot send a object"):
        flatten({"x": object()})


@pytest.mark.parametrize("cache", [True, False])
@distributed_test(2)
def test_metadata_sent_once_and_resent_on_change(rank: int, world_size: int, cache: bool) -> None:
    mesh = ProcessGroupMesh(2, axis_names=("pp",))
    group = mesh.get_group_along_axis("pp")
    p2p = PipelineP2P(group, enable_metadata_cache=cache)
    plan = [(1.0, 3), (2.0, 3), (3.0, 3), (4.0, 6), (5.0, 6)]  # shape changes at the 4th transfer
    messages = []
    for scale, rows in plan:
        with CommTracker() as tracker:
            if rank == 0:
                p2p.send(_tree(scale, rows), dst=1, tag=5)
                p2p.wait_sends()
            else:
                got = p2p.recv(src=0, tag=5)
                assert _same(got, _tree(scale, rows)), f"transfer {scale} arrived wrong"
        messages.append(tracker.calls("send" if rank == 0 else "recv"))
    if cache:
        assert messages == [2, 1, 1, 2, 1], messages
        assert (p2p.metadata_sent if rank == 0 else p2p.metadata_received) == 2
    else:
        assert messages == [2] * 5, messages
        assert (p2p.metadata_sent if rank == 0 else p2p.metadata_received) == 5
    # a changed non-tensor value is metadata too
    if rank == 0:
        p2p.send({"x": torch.ones(2), "flag": "changed"}, dst=1, tag=5)
        p2p.wait_sends()
    else:
        assert p2p.recv(src=0, tag=5)["flag"] == "changed"
    # both ranks send a large tensor to each other in one exchange: no deadlock
    big = torch.full((1 << 20,), float(rank))
    (pending,) = p2p.exchange([(big, 1 - rank, 9)], [(1 - rank, 9)])
    assert torch.equal(pending.wait(), torch.full((1 << 20,), float(1 - rank)))
    p2p.wait_all()


@distributed_test(2)
def test_receives_posted_ahead_in_a_step(rank: int, world_size: int) -> None:
    mesh = ProcessGroupMesh(2, axis_names=("pp",))
    p2p = PipelineP2P(mesh.get_group_along_axis("pp"))
    steps = [[(1.0, 3), (2.0, 3)], [(3.0, 3), (4.0, 6), (5.0, 6)], [(6.0, 6), (7.0, 6)]]
    for plan in steps:  # the shapes change inside the second step
        p2p.begin_step()
        if rank == 0:
            for scale, rows in plan:
                p2p.send(_tree(scale, rows), dst=1, tag=5)
        else:  # every receive of the step is posted before the first is waited for
            pending = p2p.exchange([], [(0, 5)] * len(plan))
            for (scale, rows), p in zip(reversed(plan), reversed(pending), strict=True):
                assert _same(p.wait(), _tree(scale, rows)), f"transfer {scale} arrived wrong"
        p2p.end_step()
    # metadata once per change (the first transfer, then the new shape); then one message each
    assert (p2p.metadata_sent if rank == 0 else p2p.metadata_received) == 2
    with CommTracker() as tracker:
        p2p.begin_step()
        if rank == 0:
            p2p.send(_tree(8.0, 6), dst=1, tag=5)
        else:
            assert _same(p2p.recv(src=0, tag=5), _tree(8.0, 6))
        p2p.end_step()
    assert tracker.calls("send" if rank == 0 else "recv") == 1


@distributed_test(2)
def test_schedule_resends_metadata_when_shapes_change(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList(Block(8) for _ in range(4))
    sm = make_stage_manager(world_size)
    model = split_model(layers, sm)[0]
    schedule = OneForwardOneBackwardSchedule(sm, microbatch_size=2, record_timeline=True)
    counter = (
        (lambda: schedule.p2p.metadata_sent)
        if sm.stage == 0
        else (lambda: schedule.p2p.metadata_received)
    )
    seen = []
    for shape in [(4, 8), (4, 8), (6, 3, 8), (6, 3, 8)]:
        schedule.forward_backward_step(model, iter([torch.randn(*shape)]), mse_to_flipped)
        seen.append(counter())
    ir = schedule.get_ir(3)
    mine = ir.actions[sm.stage]
    assert [e.action for e in schedule.last_timeline] == [a for a in mine if a.type.is_compute]
    assert [e.action for e in schedule.last_comm_timeline] == [a for a in mine if a.type.is_comm]
    assert len(schedule.last_wait_timeline) == sum(a.type.name.startswith("RECV") for a in mine)
    # activations go 0 -> 1 and gradients 1 -> 0: one new metadata per direction per change
    assert seen == [1, 1, 2, 2], seen
    assert schedule.p2p.metadata_sent == schedule.p2p.metadata_received == seen[-1]
