"""Every schedule's loss and gradients equal the unpipelined single-process reference."""

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

from colossal.core import OptimizerWrapper
from colossal.core.testing import assert_rel_close, distributed_test
from colossal.pipeline import (
    GPipeSchedule,
    InterleavedSchedule,
    OneForwardOneBackwardSchedule,
    ZeroBubbleVPipeScheduler,
)
from colossal.pipeline.executor import RECV_LOOKAHEAD

# (schedule, chunks) pairs each schedule allows
CASES = {
    "gpipe": [1, 2],
    "1f1b": [1],
    "interleaved": [1, 2],
    "zbv": [2],
}


def _schedule(kind: str, sm, chunks: int, num_microbatches: int, lookahead: int):
    kw = {"num_microbatches": num_microbatches, "recv_lookahead": lookahead}
    if kind == "gpipe":
        return GPipeSchedule(sm, **kw)
    if kind == "1f1b":
        return OneForwardOneBackwardSchedule(sm, **kw)
    if kind == "interleaved":
        return InterleavedSchedule(sm, chunks, **kw)
    return ZeroBubbleVPipeScheduler(sm, 2, **kw)


@pytest.mark.parametrize("kind", list(CASES))
@distributed_test(2, 4)
def test_matches_reference(rank: int, world_size: int, kind: str) -> None:
    for chunks in CASES[kind]:
        # receives posted by default, where the IR has them, and all at the start of the step
        for use_optimizer, lookahead in ((False, RECV_LOOKAHEAD), (True, 0), (False, 1000)):
            torch.manual_seed(0)
            layers = nn.ModuleList(Block(8) for _ in range(2 * world_size * chunks + 1))
            batch = torch.randn(2 * world_size, 8)
            with torch.no_grad():  # the unsplit model's outputs = microbatch outputs in order
                ref_out = batch
                for layer in copy.deepcopy(layers):
                    ref_out = layer(ref_out)
            ref_loss, ref = reference(layers, batch, mse_to_flipped)
            sm = make_stage_manager(world_size, chunks, zbv=kind == "zbv")
            model = split_model(layers, sm)
            schedule = _schedule(kind, sm, chunks, world_size * 2, lookahead)
            opt = (
                OptimizerWrapper(torch.optim.SGD(layers.parameters(), lr=0.1))
                if use_optimizer
                else None
            )
            out = schedule.forward_backward_step(
                model if chunks > 1 else model[0],
                iter([batch]),
                mse_to_flipped,
                optimizer=opt,
                return_loss=True,
                return_outputs=True,
            )
            what = f"{kind} chunks={chunks} lookahead={lookahead} stage={sm.stage}"
            assert compare_grads(layers, ref, model, what) > 0
            holds_last = sm.layout.loss_stage() == sm.stage
            if holds_last:
                assert_rel_close(out["loss"], ref_loss, RTOL, f"{what}: loss")
                assert out["outputs"].shape == batch.shape
                assert_rel_close(out["outputs"], ref_out, RTOL, f"{what}: outputs")
            else:
                assert out["loss"] is None and out["outputs"] is None


@pytest.mark.parametrize("kind", list(CASES))
@distributed_test(2, 4)
def test_forward_only_under_no_grad(rank: int, world_size: int, kind: str) -> None:
    # Evaluation: the unsplit model's loss and outputs, and no gradient anywhere. Catches a
    # schedule that still runs its backwards (gradients appear, or the stages wait forever
    # for gradients the forward-only IR never sends) and outputs reordered over microbatches.
    for chunks in CASES[kind]:
        torch.manual_seed(0)
        layers = nn.ModuleList(Block(8) for _ in range(2 * world_size * chunks + 1))
        batch = torch.randn(2 * world_size, 8)
        with torch.no_grad():
            ref_out = batch
            for layer in layers:
                ref_out = layer(ref_out)
            ref_loss = mse_to_flipped(ref_out, batch)
        sm = make_stage_manager(world_size, chunks, zbv=kind == "zbv")
        model = split_model(layers, sm)
        schedule = _schedule(kind, sm, chunks, world_size * 2, RECV_LOOKAHEAD)
        opt = OptimizerWrapper(torch.optim.SGD(layers.parameters(), lr=0.1))
        for _ in range(2):  # the forward IR is cached; a second call runs it again
            with torch.no_grad():
                out = schedule.forward_backward_step(
                    model if chunks > 1 else model[0], iter([batch]), mse_to_flipped,
                    optimizer=opt, return_loss=True, return_outputs=True,
                )
            what = f"{kind} chunks={chunks} stage={sm.stage}"
            assert all(p.grad is None for p in layers.parameters()), what
            if sm.layout.loss_stage() == sm.stage:
                assert not out["loss"].requires_grad, what
                assert_rel_close(out["loss"], ref_loss, RTOL, f"{what}: loss")
                assert_rel_close(out["outputs"], ref_out, RTOL, f"{what}: outputs")
            else:
                assert out["loss"] is None and out["outputs"] is None, what
