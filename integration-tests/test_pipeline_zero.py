"""Pipeline schedules (1F1B, ZB-V) stepping a ZeRO-1 optimizer match one process.

Meshes of 2 stages x 1 data-parallel rank (world 2) and 2 stages x 2 data-parallel ranks
(world 4): each stage wraps its parameters' AdamW in ``LowLevelZeroOptimizer`` (stage 1) over
its data-parallel group, the schedule runs the backward through it and a post-backward hook
steps it. After every step the loss and the global gradient norm, and after the last step
every parameter, are compared with a single process training the unsplit model on the global
batch. fp32 must agree to a relative error of 1e-5; fp16 (master weights fp32, loss scale
2**8) is compared with the same fp32 reference to 5e-3 (parameters and loss) and 5e-2 (norm).
The model and stage split are copied from colossal-pipeline's test helpers.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from colossal.core import ProcessGroupMesh
from colossal.core.comm import CommTracker
from colossal.core.testing import distributed_test, relative_error
from colossal.pipeline import (
    OneForwardOneBackwardSchedule,
    PipelineStageManager,
    ZeroBubbleVPipeScheduler,
)
from colossal.zero import LowLevelZeroOptimizer

DIM, LAYERS, GLOBAL_BATCH, MICROBATCHES, STEPS = 8, 8, 16, 4, 3
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
TOL = {"fp32": 1e-5, "fp16": 5e-3}  # loss and parameters; the grad norm gets 10x
LR, WEIGHT_DECAY, SCALE = 1e-2, 0.01, 2.0**8


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Stack(nn.Module):
    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def criterion(out: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    """MSE to the flipped input, in fp32 whatever the model's dtype."""
    return ((out.float() - batch.float().flip(-1)) ** 2).mean()


def global_batch(step: int) -> torch.Tensor:
    return torch.randn(GLOBAL_BATCH, DIM, generator=torch.Generator().manual_seed(10 + step))


def split_model(layers: nn.ModuleList, sm: PipelineStageManager) -> list[nn.Module]:
    ranges = sm.get_stage_index(sm.distribute_layers(len(layers)))
    ranges = [ranges] if isinstance(ranges, tuple) else ranges
    return [Stack(list(layers[a:b])) for a, b in ranges]


def reference(layers: nn.ModuleList) -> tuple[list[float], list[float], nn.ModuleList]:
    """Losses, gradient norms and final model of one process on the whole global batch."""
    ref = copy.deepcopy(layers)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses, norms = [], []
    for step in range(STEPS):
        batch = global_batch(step)
        out = batch
        for layer in ref:
            out = layer(out)
        loss = criterion(out, batch)
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf"))))
        opt.step()
        losses.append(loss.item())
    return losses, norms, ref


def _setup(world_size: int, kind: str) -> tuple[ProcessGroupMesh, PipelineStageManager]:
    mesh = ProcessGroupMesh(2, world_size // 2, axis_names=("pp", "dp"))
    zbv = kind == "zbv"
    sm = PipelineStageManager(mesh, "pp", num_model_chunks=2 if zbv else 1, use_zbv=zbv)
    return mesh, sm


def _schedule(kind: str, sm: PipelineStageManager):
    if kind == "zbv":
        return ZeroBubbleVPipeScheduler(sm, 2, num_microbatches=MICROBATCHES)
    return OneForwardOneBackwardSchedule(sm, num_microbatches=MICROBATCHES)


@pytest.mark.parametrize("precision", list(DTYPES))
@pytest.mark.parametrize("kind", ["1f1b", "zbv"])
@distributed_test(2, 4)
def test_pipeline_steps_zero1_like_one_process(
    rank: int, world_size: int, kind: str, precision: str
) -> None:
    dtype, tol = DTYPES[precision], TOL[precision]
    torch.manual_seed(0)
    layers = nn.ModuleList(Block(DIM) for _ in range(LAYERS))
    ref_losses, ref_norms, ref = reference(layers)

    mesh, sm = _setup(world_size, kind)
    dp_group = mesh.get_group_along_axis("dp")
    dp_ranks, dp_size, dp_rank = mesh.ranks_along_axis("dp"), mesh.size("dp"), mesh.coordinate("dp")
    pipe = copy.deepcopy(layers).to(dtype)
    chunks = split_model(pipe, sm)
    params = [p for c in chunks for p in c.parameters()]
    zero = LowLevelZeroOptimizer(
        torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY),
        dp_process_group=dp_group,
        pp_process_group=mesh.get_group_along_axis("pp"),
        reduce_bucket_size=100,  # several buckets per stage
        initial_scale=SCALE,
    )
    assert len(zero.buckets) > 1
    schedule = _schedule(kind, sm)
    schedule.register_post_backward_hook(zero.step)
    model = chunks if kind == "zbv" else chunks[0]
    holds_loss = sm.layout.loss_stage() == sm.stage
    losses, norms = [], []
    for step in range(STEPS):
        rows = GLOBAL_BATCH // dp_size
        local = global_batch(step)[dp_rank * rows : (dp_rank + 1) * rows].to(dtype)
        zero.zero_grad()
        with CommTracker() as tracker:
            out = schedule.forward_backward_step(
                model, iter([local]), criterion, optimizer=zero, return_loss=True
            )
        if dp_size > 1:
            # one reduction per bucket for the whole step (not one per microbatch: an
            # all-reduce on gloo, a reduce-scatter through shared memory); the gradient norm
            # is one scalar all-reduce over the whole job (the parameters lie along pp too)
            calls = tracker.calls("all_reduce", group=dp_ranks) + tracker.calls(
                "reduce_scatter", group=dp_ranks
            )
            assert calls == len(zero.buckets), f"{calls} reductions for {len(zero.buckets)}"
            job = tuple(range(dist.get_world_size()))
            assert tracker.calls("all_reduce", group=job) == 1, tracker.table()
        norms.append(zero.get_grad_norm())
        if holds_loss:
            loss = out["loss"].detach().float().reshape(1).clone()
            dist.all_reduce(loss, group=dp_group)
            losses.append(loss.item() / dp_size)
        else:
            assert out["loss"] is None
    what = f"{kind} {precision} world={world_size} stage={sm.stage}"
    assert zero.loss_scale == (SCALE if precision == "fp16" else 1.0), f"{what}: a step overflowed"
    norm_err = relative_error(torch.tensor(norms), torch.tensor(ref_norms))
    assert norm_err <= 10 * tol, f"{what}: grad norms {norms} vs {ref_norms}"
    if holds_loss:
        loss_err = relative_error(torch.tensor(losses), torch.tensor(ref_losses))
        assert loss_err <= tol, f"{what}: losses {losses} vs {ref_losses}"
    mine = {id(p) for p in params}
    checked = 0
    for (name, p), q in zip(pipe.named_parameters(), ref.parameters(), strict=True):
        if id(p) in mine:
            err = relative_error(p.float(), q)
            assert err <= tol, f"{what}: {name} relative error {err:.2e} > {tol:.0e}"
            checked += 1
    assert checked == len(params)


@distributed_test(2)
def test_zero2_under_a_pipeline_is_refused(rank: int, world_size: int) -> None:
    mesh, sm = _setup(world_size, "1f1b")
    torch.manual_seed(0)
    chunks = split_model(nn.ModuleList(Block(DIM) for _ in range(LAYERS)), sm)
    zero = LowLevelZeroOptimizer(
        torch.optim.AdamW(chunks[0].parameters()),
        partition_grad=True,
        dp_process_group=mesh.get_group_along_axis("dp"),
    )
    schedule = _schedule("1f1b", sm)
    with pytest.raises(ValueError, match=r"partition_grad=False"):
        schedule.forward_backward_step(
            chunks[0], iter([global_batch(0)]), criterion, optimizer=zero
        )
