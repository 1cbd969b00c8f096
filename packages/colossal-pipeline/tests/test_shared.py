"""Tied embeddings: gradients of parameters shared across stages equal the reference."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F  # noqa: N812
from helpers import RTOL, Block, make_stage_manager, split_model
from torch import nn

from colossal.core import OptimizerWrapper
from colossal.core.comm import all_gather_object
from colossal.core.testing import assert_rel_close, distributed_test
from colossal.pipeline import (
    InterleavedSchedule,
    OneForwardOneBackwardSchedule,
    ZeroBubbleVPipeScheduler,
)

VOCAB, DIM = 16, 8


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(VOCAB, DIM))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class Head(nn.Module):
    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.weight.t()


def lm_loss(logits: torch.Tensor, batch: dict) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1))


def _tied_model(num_blocks: int) -> nn.ModuleList:
    embed = Embed()
    return nn.ModuleList([embed, *(Block(DIM) for _ in range(num_blocks)), Head(embed.weight)])


def _run(world_size: int, kind: str) -> None:
    torch.manual_seed(0)
    chunks = 1 if kind == "1f1b" else 2
    ref = _tied_model(world_size * chunks - 2)
    ids = torch.randint(0, VOCAB, (8, 5))
    batch = {"input_ids": ids, "labels": ids.roll(1, dims=1)}
    pipe = copy.deepcopy(ref)
    h = batch["input_ids"]
    for i, layer in enumerate(ref):
        h = layer(h) if i else layer(**batch)
    ref_loss = lm_loss(h, batch)
    ref_loss.backward()

    sm = make_stage_manager(world_size, chunks, zbv=kind == "zbv")
    last = sm.layout.loss_stage()
    shared = None
    if last != 0:  # untie: the last stage holds its own copy, kept in sync by the schedule
        pipe[-1].weight = nn.Parameter(pipe[0].weight.detach().clone())
        shared = [{0: pipe[0].weight, last: pipe[-1].weight}]
    if kind == "1f1b":
        schedule = OneForwardOneBackwardSchedule(sm, num_microbatches=2, shared_params=shared)
    elif kind == "interleaved":
        schedule = InterleavedSchedule(sm, 2, num_microbatches=2 * world_size, shared_params=shared)
    else:
        schedule = ZeroBubbleVPipeScheduler(sm, num_microbatches=2, shared_params=shared)
    model = split_model(pipe, sm)
    params = [p for c in model for p in c.parameters()]
    opt = OptimizerWrapper(torch.optim.SGD(params, lr=0.5))
    schedule.register_post_backward_hook(opt.step)
    out = schedule.forward_backward_step(
        model if chunks > 1 else model[0], iter([batch]), lm_loss, optimizer=opt, return_loss=True
    )
    if sm.stage == last:
        assert_rel_close(out["loss"], ref_loss, RTOL, f"{kind}: loss")
    ref_params = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        if any(p is q for q in params):
            ref_name = "0.weight" if name.endswith(f"{len(pipe) - 1}.weight") else name
            assert_rel_close(
                p.grad, ref_params[ref_name].grad, RTOL, f"{kind} stage {sm.stage}: {name}"
            )
    # the hook stepped the optimizer; tied copies moved together
    mine = {}
    if sm.stage == 0:
        mine["embed"] = pipe[0].weight.detach().clone()
    if sm.stage == last:
        mine["head"] = pipe[-1].weight.detach().clone()
    gathered = {k: v for d in all_gather_object(mine) for k, v in d.items()}
    assert not torch.equal(gathered["embed"], ref[0].weight.detach()), "the hook did not step"
    assert torch.equal(gathered["embed"], gathered["head"]), f"{kind}: tied copies drifted apart"


@distributed_test(2, 4)
def test_tied_weights(rank: int, world_size: int) -> None:
    for kind in ("1f1b", "interleaved", "zbv"):
        _run(world_size, kind)


@distributed_test(2)
def test_accumulating_calls_sum_tied_weights_once(rank: int, world_size: int) -> None:
    """Two calls on the two halves of a batch (the first with ``sync_shared_params=False``)
    give the tied copies the gradient of one call on the whole batch (halved losses).

    Summing after every call would count the first half's gradient twice.
    """
    torch.manual_seed(0)
    ref = _tied_model(0)
    ids = torch.randint(0, VOCAB, (8, 5))
    batch = {"input_ids": ids, "labels": ids.roll(1, dims=1)}
    pipe = copy.deepcopy(ref)
    lm_loss(ref[1](ref[0](**batch)), batch).backward()
    sm = make_stage_manager(world_size, 1)
    pipe[-1].weight = nn.Parameter(pipe[0].weight.detach().clone())
    schedule = OneForwardOneBackwardSchedule(
        sm, num_microbatches=2, shared_params=[{0: pipe[0].weight, 1: pipe[-1].weight}]
    )
    model = split_model(pipe, sm)[0]
    halves = [{k: v[:4] for k, v in batch.items()}, {k: v[4:] for k, v in batch.items()}]
    for i, half in enumerate(halves):
        schedule.forward_backward_step(
            model, iter([half]), lambda o, b: lm_loss(o, b) / 2, sync_shared_params=i == 1
        )
    mine = pipe[0].weight if sm.stage == 0 else pipe[-1].weight
    assert_rel_close(mine.grad, ref[0].weight.grad, RTOL, f"stage {sm.stage}: tied gradient")
