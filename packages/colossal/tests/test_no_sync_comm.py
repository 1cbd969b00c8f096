"""``booster.no_sync`` sends nothing; the synced backward that ends the accumulation does.

``test_api.test_no_sync_accumulation`` checks the accumulated gradients, which a ``no_sync``
that still communicates gets right too (the reduction only moves earlier). These tests count
the communication itself: under ZeRO with core's comm tracker (every collective of
``colossal.zero`` goes through ``colossal.core.comm``), under DDP with a comm hook (torch
DDP's all-reduces bypass Colossal's helpers).
"""

from __future__ import annotations

from typing import Any

import torch
from booster_testlib import local_batch, make_booster, make_model, make_optimizer
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from colossal.core.comm import CommTracker, shm
from colossal.core.testing import distributed_test


def _micro_batches(rank: int, world_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = local_batch(0, rank, world_size)
    return [(x[:2], y[:2]), (x[2:], y[2:])]


def _accumulate(model: Any, optimizer: Any, booster: Any, rank: int, world_size: int) -> None:
    """Backward of the first micro-batch under ``no_sync``."""
    (x, y), _ = _micro_batches(rank, world_size)
    with booster.no_sync(model, optimizer):
        booster.backward(nn.functional.mse_loss(model(x), y) / 2, optimizer)


def _synced(model: Any, optimizer: Any, booster: Any, rank: int, world_size: int) -> None:
    """Backward of the second micro-batch, synced."""
    _, (x, y) = _micro_batches(rank, world_size)
    booster.backward(nn.functional.mse_loss(model(x), y) / 2, optimizer)


@distributed_test(2)
def test_zero1_no_sync_sends_nothing(rank: int, world_size: int) -> None:
    booster = make_booster("zero1")
    plain = make_model()
    numel = sum(p.numel() for p in plain.parameters())
    model, optimizer, *_ = booster.boost(plain, make_optimizer(plain))
    with CommTracker() as accumulating:
        _accumulate(model, optimizer, booster, rank, world_size)
    assert (accumulating.calls(), accumulating.bytes()) == (0, 0), accumulating.table()
    with CommTracker() as synced:
        _synced(model, optimizer, booster, rank, world_size)
    # Stage 1: every (fp32) gradient is reduced once (each bucket padded to a multiple of the
    # world size; a reduce-scatter into this rank's slice through shared memory, else an
    # all-reduce), nothing else is sent.
    kind = "reduce_scatter" if shm.available(None, torch.empty(0)) else "all_reduce"
    calls = synced.calls(kind)
    assert synced.calls() == calls > 0, synced.table()
    assert 4 * numel <= synced.bytes() <= 4 * (numel + world_size * calls), synced.table()
    optimizer.step()


@distributed_test(2)
def test_ddp_no_sync_sends_nothing(rank: int, world_size: int) -> None:
    booster = make_booster("ddp")
    plain = make_model()
    numel = sum(p.numel() for p in plain.parameters())
    model, optimizer, *_ = booster.boost(plain, make_optimizer(plain))
    ddp = next(m for m in model.modules() if isinstance(m, DistributedDataParallel))
    reduced: list[int] = []

    # No annotations: DDP checks them at runtime, and they are strings in this module.
    def counting_hook(state, bucket):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202
        reduced.append(bucket.buffer().numel())
        return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]

    ddp.register_comm_hook(None, counting_hook)
    _accumulate(model, optimizer, booster, rank, world_size)
    assert reduced == [], f"no_sync reduced buckets of {reduced} elements"
    _synced(model, optimizer, booster, rank, world_size)
    assert sum(reduced) == numel, f"the synced backward reduced {reduced} of {numel} elements"
    optimizer.step()
