"""Engine loops under data parallelism equal one process on the same global samples.

Each case trains a tiny MLP with SGD (so a wrong gradient scale shows) for a few optimizer
steps at world 2 and compares every parameter, after every step, with one process that
takes the whole global batch (max error 1e-6; one step moves parameters by ~1e-2).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from colossal.core.testing import distributed_test
from colossal.legacy import init_context, initialize
from colossal.legacy.core import gpc
from colossal.legacy.engine.gradient_accumulation import (
    GradAccumDataloader,
    GradAccumLrSchedulerByStep,
    GradAccumOptimizer,
)
from colossal.legacy.engine.gradient_handler import (
    DataParallelGradientHandler,
    ZeROGradientHandler,
)
from colossal.zero import LowLevelZeroOptimizer

LR = 0.5
STEPS = 3
GLOBAL_BATCH = 8
CLIP = 0.05  # well below the gradient norms here (checked: >= 0.3)
TOL = 1e-6


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, GLOBAL_BATCH, 6, generator=g), torch.randint(
        0, 3, (STEPS, GLOBAL_BATCH), generator=g
    )


def _reference(clip: float) -> list[list[torch.Tensor]]:
    """Parameters after each step of one process on the whole global batch."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    xs, ys = _data()
    out = []
    for x, y in zip(xs, ys, strict=True):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            assert norm > 6 * clip, "clipping must matter in this test"
        opt.step()
        out.append([p.detach().clone() for p in model.parameters()])
    return out


def _params(engine: Any, model: nn.Module) -> list[torch.Tensor]:
    wait = getattr(engine.optimizer, "wait_params", None)
    if wait is not None:  # ZeRO's parameter all-gather may still be in flight
        wait()
    return [p.detach().clone() for p in model.parameters()]


def _train(config: dict, manual_loop: bool = False) -> tuple[Any, list[list[torch.Tensor]]]:
    """Engine steps at this world size on this rank's share of each global batch."""
    init_context(config, verbose=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    accum = config.get("gradient_accumulation", 1)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = initialize(model, optimizer, nn.CrossEntropyLoss(), verbose=False)
    xs, ys = _data()
    micro = GLOBAL_BATCH // (world * accum)
    after = []
    for x, y in zip(xs, ys, strict=True):
        for k in range(accum):
            lo = (k * world + rank) * micro
            batch = (x[lo : lo + micro], y[lo : lo + micro])
            before = _params(engine, model)
            engine.zero_grad()
            if manual_loop:  # the seeds' loop: engine(img), engine.criterion, backward, step
                engine.backward(engine.criterion(engine(batch[0]), batch[1]))
            else:
                _, _, loss = engine.execute_schedule(iter([batch]), return_output_label=False)
                assert loss is not None and loss.dim() == 0
            engine.step()
            if k < accum - 1:  # mid-cycle: no optimizer step
                for a, b in zip(before, _params(engine, model), strict=True):
                    assert torch.equal(a, b), f"{config}: stepped mid-accumulation"
        after.append(_params(engine, model))
    return engine, after


def _check(config: dict, manual_loop: bool = False) -> Any:
    engine, got = _train(config, manual_loop)
    want = _reference(config.get("clip_grad_norm", 0.0))
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        for a, b in zip(g, w, strict=True):
            err = (a - b).abs().max().item()
            assert err < TOL, f"{config}: step {step} differs from one process by {err}"
    gpc.destroy()
    return engine


@distributed_test(2)
def test_data_parallel_paths_equal_one_process(rank: int, world_size: int) -> None:
    """Catches a wrong gradient average (sum instead of mean, a missed all-reduce), a
    handler or clip that runs at the wrong point, and a loss not divided by the
    accumulation size: DDP, DataParallelGradientHandler, clipping and accumulation."""
    torch.set_num_threads(1)
    engine = _check({})
    assert isinstance(engine.model, DistributedDataParallel) and not engine.gradient_handlers
    handler = dict(gradient_handler=[dict(type="DataParallelGradientHandler")])
    engine = _check(handler, manual_loop=True)
    assert not isinstance(engine.model, DistributedDataParallel)
    assert [type(h) for h in engine.gradient_handlers] == [DataParallelGradientHandler]
    _check(dict(clip_grad_norm=CLIP))
    _check(dict(clip_grad_norm=CLIP, **handler), manual_loop=True)
    engine = _check(dict(gradient_accumulation=2))
    assert isinstance(engine.optimizer, GradAccumOptimizer)
    _check(dict(gradient_accumulation=2, clip_grad_norm=CLIP, **handler))


@distributed_test(2)
def test_zero_equals_one_process(rank: int, world_size: int) -> None:
    """Catches ZeRO not reducing over the DATA group, a doubly averaged or unclipped
    gradient under ZeRO, and accumulation that reduces (or steps) every micro-step."""
    torch.set_num_threads(1)
    engine = _check(dict(zero=dict(stage=2)))
    assert isinstance(engine.optimizer, LowLevelZeroOptimizer)
    assert engine.optimizer.config.partition_grad
    assert [type(h) for h in engine.gradient_handlers] == [ZeROGradientHandler]
    assert not isinstance(engine.model, DistributedDataParallel)
    engine = _check(dict(zero=dict(level=1), clip_grad_norm=CLIP, gradient_accumulation=2))
    assert not engine.optimizer.inner.config.partition_grad
    _check(dict(zero=dict(stage=2, reduce_bucket_size=64), gradient_accumulation=2))


def _grads_agree(model: nn.Module) -> bool:
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    other = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(other, flat)
    return all(torch.equal(other[0], o) for o in other)


@pytest.mark.parametrize("handler", [False, True])
@distributed_test(2)
def test_accumulation_steps_optimizer_and_scheduler_every_second_step(
    rank: int, world_size: int, handler: bool
) -> None:
    """Catches an optimizer or lr scheduler that steps every micro-step, a gradient
    all-reduce on the first micro-step (DDP no_sync / the handler not deferred), and a
    dataloader that keeps an unfinishable cycle."""
    torch.set_num_threads(1)
    config: dict = dict(gradient_accumulation=2)
    if handler:
        config["gradient_handler"] = [dict(type="DataParallelGradientHandler")]
    init_context(config, verbose=False)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    g = torch.Generator().manual_seed(2 + rank)  # different data on each rank
    loader = [(torch.randn(2, 6, generator=g), torch.randint(0, 3, (2,), generator=g))] * 5
    engine, train_dl, _, lr_sched = initialize(
        model,
        optimizer,
        nn.CrossEntropyLoss(),
        train_dataloader=loader,
        lr_scheduler=scheduler,
        verbose=False,
    )
    assert isinstance(train_dl, GradAccumDataloader) and len(train_dl) == 4
    assert isinstance(lr_sched, GradAccumLrSchedulerByStep)
    steps, lrs, synced = [], [], []
    it = iter(train_dl)
    for _ in range(len(train_dl)):
        before = [p.detach().clone() for p in model.parameters()]
        engine.zero_grad()
        engine.execute_schedule(it, return_output_label=False)
        if not handler:  # DDP reduces in the backward; the handler in engine.step()
            synced.append(_grads_agree(model))
        engine.step()
        if handler:
            synced.append(_grads_agree(model))
        lr_sched.step()
        now = list(model.parameters())
        steps.append(any(not torch.equal(a, b) for a, b in zip(before, now, strict=True)))
        lrs.append(optimizer.param_groups[0]["lr"])
    assert steps == [False, True, False, True]
    assert synced == [False, True, False, True], (synced, steps, lrs)
    assert lrs == [LR, LR / 2, LR / 2, LR / 4]
    assert sum(1 for _ in train_dl) == 4  # a fresh epoch has the same length
    gpc.destroy()
