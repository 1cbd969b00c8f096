"""ColossalAI's ZB-V names: PipelineGraph's node schedule, running it, WeightGradStore."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import (
    RTOL,
    Block,
    compare_grads,
    make_stage_manager,
    mse_to_flipped,
    reference,
    split_model,
)
from torch import nn

from colossal.core.testing import assert_rel_close, distributed_test
from colossal.pipeline import (
    LinearWithGradAccum,
    OneForwardOneBackwardSchedule,
    PipelineGraph,
    ScheduledNode,
    WeightGradStore,
    ZeroBubbleVPipeScheduler,
    simulate,
)
from colossal.pipeline.v_schedule import nodes_to_ir


@pytest.mark.parametrize(("stages", "micro", "c_cost"), [(2, 4, 0.0), (4, 8, 1.0), (3, 5, 2.0)])
def test_v_schedule_is_valid(stages: int, micro: int, c_cost: float) -> None:
    """Every F before its B before its W on each stage, 2M of each per stage, times in order.

    Catches: a node list missing or repeating a (microbatch, chunk), a W before its B (the
    weight gradient of a graph not yet backpropagated), ColossalAI's "B" mapped to a full
    backward, simulated times that overlap on one stage, the generator stuck with transfer
    delays (ColossalAI's examples pass c_cost=1).
    """
    h, a, s = 16, 2, 8  # ColossalAI's example memory model
    f_mem = 34 * h + 5 * a * s
    w_mem = -32 * h
    graph = PipelineGraph(stages, micro, 1, 1, 1, c_cost, f_mem, -w_mem - f_mem, w_mem)
    nodes = graph.get_v_schedule()
    assert isinstance(nodes, list) and len(nodes) == stages
    for stage, row in enumerate(nodes):
        seen: dict[tuple[str, int, int], int] = {}
        last_end = 0.0
        for position, node in enumerate(row):
            assert node.stage == stage
            if node.type in ("F", "B", "W"):
                key = (node.type, node.minibatch, node.chunk)
                assert key not in seen, f"stage {stage} runs {key} twice"
                seen[key] = position
                assert node.start_time >= last_end - 1e-9 and node.completion_time > node.start_time
                last_end = node.completion_time
        for mb in range(micro):
            for chunk in (0, 1):
                f, b, w = (seen[(t, mb, chunk)] for t in ("F", "B", "W"))
                assert f < b < w, f"stage {stage} mb {mb} chunk {chunk}: F{f} B{b} W{w}"
        assert len(seen) == 3 * 2 * micro
    step = graph.get_v_schedule(only_run_time=True)
    assert step == pytest.approx(max(n.completion_time for row in nodes for n in row))


def test_max_mem_limits_activations() -> None:
    """Catches: max_mem ignored (peak activations above max_mem // f_mem)."""
    graph = PipelineGraph(4, 8, 1, 1, 1, 1, f_mem=2.0, b_mem=0.0, w_mem=-2.0, max_mem=5.0)
    ir = nodes_to_ir(graph.get_v_schedule())  # type: ignore[arg-type]
    assert max(simulate(ir, graph.costs).peak_activations) <= 2
    with pytest.raises(ValueError, match="raise max_mem"):
        PipelineGraph(2, 2, f_mem=2.0, max_mem=1.0)
    with pytest.raises(ValueError, match="n_micro=0"):
        PipelineGraph(2, 0)
    with pytest.raises(ValueError, match="unknown node type"):
        nodes_to_ir([[ScheduledNode("X", 0, 0, 0)]])


@distributed_test(2)
def test_zbv_runs_the_graph_like_1f1b(rank: int, world_size: int) -> None:
    """ZeroBubbleVPipeScheduler(schedule=graph nodes) gives 1F1B's loss and gradients.

    Catches: schedule= ignored or mis-converted (a deadlock, or gradients of the wrong
    microbatch), ColossalAI's num_microbatch spelling refused, a microbatch count mismatch
    not named.
    """
    torch.set_num_threads(1)
    micro = 2 * world_size
    results = {}
    for kind in ("1f1b", "zbv"):
        torch.manual_seed(0)
        chunks = 2 if kind == "zbv" else 1
        layers = nn.ModuleList(Block(8) for _ in range(2 * world_size * chunks + 1))
        batch = torch.randn(micro, 8, generator=torch.Generator().manual_seed(3))
        ref_loss, ref = reference(copy.deepcopy(layers), batch, mse_to_flipped)
        sm = make_stage_manager(world_size, chunks, zbv=kind == "zbv")
        model = split_model(layers, sm)
        if kind == "zbv":
            nodes = PipelineGraph(world_size, micro, 1, 1, 1, 1).get_v_schedule()
            schedule = ZeroBubbleVPipeScheduler(
                sm, schedule=nodes, num_model_chunks=2, num_microbatch=micro
            )
            with pytest.raises(ValueError, match="n_micro=3"):
                schedule.get_ir(3)
        else:
            schedule = OneForwardOneBackwardSchedule(sm, num_microbatches=micro)
        out = schedule.forward_backward_step(
            model if chunks > 1 else model[0], iter([batch]), mse_to_flipped, return_loss=True
        )
        assert compare_grads(layers, ref, model, kind) > 0
        if sm.layout.loss_stage() == sm.stage:
            results[kind] = out["loss"]
            assert_rel_close(out["loss"], ref_loss, RTOL, f"{kind}: loss")
    if len(results) == 2:
        assert_rel_close(results["zbv"], results["1f1b"], RTOL, "zbv vs 1f1b loss")


def test_linear_with_grad_accum_defers_weight_grad() -> None:
    """Catches: use_zbv still returning the weight gradient (counted twice), pop computing
    another shape or forgetting to accumulate, flush/pop mixing chunks."""
    WeightGradStore.clear()
    torch.manual_seed(0)
    linear = nn.Linear(4, 3)
    x = torch.randn(2, 5, 4, requires_grad=True)
    linear(x).square().sum().backward()
    want_w, want_b, want_x = linear.weight.grad.clone(), linear.bias.grad.clone(), x.grad.clone()
    linear.zero_grad(set_to_none=True)
    x.grad = None
    for round_ in range(2):  # the second accumulates into the first
        y = LinearWithGradAccum.apply(x, linear.weight, linear.bias, False, True)
        y.square().sum().backward()
        assert round_ > 0 or linear.weight.grad is None
        WeightGradStore.flush(chunk=1)
        with pytest.raises(RuntimeError, match="nothing was flushed"):
            WeightGradStore.pop(chunk=0)
        WeightGradStore.pop(chunk=1)
    torch.testing.assert_close(linear.weight.grad, 2 * want_w)
    torch.testing.assert_close(linear.bias.grad, 2 * want_b)
    torch.testing.assert_close(x.grad, 2 * want_x)
    plain = nn.Linear(4, 3)
    plain.load_state_dict(linear.state_dict())
    LinearWithGradAccum.apply(x, plain.weight, plain.bias, False, False).square().sum().backward()
    torch.testing.assert_close(plain.weight.grad, want_w)
