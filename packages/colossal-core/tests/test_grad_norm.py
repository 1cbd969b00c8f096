"""Global grad norm over sharded parameters equals torch's norm of the unsharded model."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from colossal.core import (
    Block,
    Blocks,
    CommTracker,
    OptimizerWrapper,
    clip_grad_norm_,
    grad_norm,
    mark_sharded,
)
from colossal.core.testing import assert_rel_close, distributed_test

JUNK = 1e3  # padding gradients this large would dominate any norm that counted them


def _full_model() -> dict[str, nn.Parameter]:
    """The unsharded parameters, with gradients, of a tiny TP-style model."""
    gen = torch.Generator().manual_seed(0)
    shapes = {
        "embed": (7, 4),  # vocab 7, padded to 8 rows at TP 2
        "col.weight": (10, 4),  # column-parallel: rows split
        "col.bias": (10,),
        "qkv.weight": (12, 4),  # fused q/k/v: three blocks of 4 rows, each split
        "row.weight": (5, 10),  # row-parallel: columns split
        "row.bias": (5,),  # replicated
        "norm.weight": (4,),  # replicated
        "frozen": (3, 3),  # no gradient
    }
    params = {}
    for name, shape in shapes.items():
        p = nn.Parameter(torch.randn(shape, generator=gen))
        if name != "frozen":
            p.grad = torch.randn(shape, generator=gen)
        params[name] = p
    return params


def _parts(rank: int, tp: int) -> dict[str, tuple[Block | Blocks, tuple[int, ...]]]:
    """Each sharded parameter's part and local (padded) shape on ``rank``."""
    rows = 8 // tp
    lo, hi = rank * rows, min(7, (rank + 1) * rows)
    qkv = Blocks(
        0,
        tuple(
            Block.along((12, 4), 0, s * 4 + rank * 4 // tp, s * 4 + (rank + 1) * 4 // tp)
            for s in range(3)
        ),
    )
    return {
        "embed": (Block.along((7, 4), 0, lo, hi), (rows, 4)),
        "col.weight": (
            Block.along((10, 4), 0, rank * 10 // tp, (rank + 1) * 10 // tp),
            (10 // tp, 4),
        ),
        "col.bias": (Block.along((10,), 0, rank * 10 // tp, (rank + 1) * 10 // tp), (10 // tp,)),
        "qkv.weight": (qkv, qkv.sizes),
        "row.weight": (
            Block.along((5, 10), 1, rank * 10 // tp, (rank + 1) * 10 // tp),
            (5, 10 // tp),
        ),
    }


def _shard(full: dict[str, nn.Parameter], rank: int, tp: int) -> list[nn.Parameter]:
    """This rank's parameters: sharded ones marked, padding gradients filled with junk."""
    parts = _parts(rank, tp)
    out = []
    for name, p in full.items():
        if name not in parts:
            local = nn.Parameter(p.detach().clone())
            local.grad = None if p.grad is None else p.grad.clone()
            out.append(local)
            continue
        part, shape = parts[name]
        local = nn.Parameter(torch.zeros(shape))
        part.real(local.data).copy_(part.take(p.detach()))
        local.grad = torch.full(shape, JUNK)
        part.real(local.grad).copy_(part.take(p.grad))
        mark_sharded(local, part, p.shape, None)
        out.append(local)
    return out


@distributed_test(2)
def test_grad_norm_matches_unsharded(rank: int, world_size: int) -> None:
    """Sharded parts summed once, replicated once, padding out; one all-reduce; clipping."""
    assert dist.get_world_size() == world_size
    for norm_type in (2.0, 1.0, 3.0, math.inf):
        full = _full_model()
        expected = torch.nn.utils.clip_grad_norm_(list(full.values()), 1e9, norm_type)
        local = _shard(full, rank, world_size)
        if rank == world_size - 1:  # the last rank holds the padding row of the vocabulary
            assert any(bool((p.grad == JUNK).any()) for p in local if p.grad is not None)
        with CommTracker() as tracker:
            got = grad_norm(local, norm_type)
        # Catches: padding counted, replicated grads summed over ranks, shards not reduced.
        assert_rel_close(got, expected, 1e-6)
        # Catches: one all-reduce per parameter instead of one per group.
        assert tracker.calls("all_reduce") == 1

    full = _full_model()
    max_norm = 0.5
    local = _shard(full, rank, world_size)
    expected = torch.nn.utils.clip_grad_norm_(list(full.values()), max_norm)
    got = clip_grad_norm_(local, max_norm)
    assert_rel_close(got, expected, 1e-6)
    parts = _parts(rank, world_size)
    for (name, ref), mine in zip(full.items(), local, strict=True):
        if ref.grad is None:
            assert mine.grad is None
            continue
        if name in parts:
            part = parts[name][0]
            assert_rel_close(part.real(mine.grad), part.take(ref.grad), 1e-6)
        else:
            assert_rel_close(mine.grad, ref.grad, 1e-6)
    # Catches a clip that scaled by the local (per-rank) norm: grads are now at max_norm.
    assert_rel_close(grad_norm(local), torch.tensor(max_norm), 1e-5)

    # The optimizer wrapper's norm and clip (what Booster users call) are the global ones.
    full = _full_model()
    local = _shard(full, rank, world_size)
    expected = torch.nn.utils.clip_grad_norm_(list(full.values()), max_norm)
    wrapper = OptimizerWrapper(torch.optim.SGD(local, lr=0.1))
    assert_rel_close(torch.tensor(wrapper.get_grad_norm()), expected, 1e-6)
    assert_rel_close(torch.tensor(wrapper.clip_grad_by_norm(max_norm)), expected, 1e-6)
    assert_rel_close(torch.tensor(wrapper.get_grad_norm()), torch.tensor(max_norm), 1e-5)


def test_grad_norm_single_process_excludes_padding() -> None:
    """Without torch.distributed a marked parameter is its own whole: its padding is out."""
    p = nn.Parameter(torch.zeros(4, 3))
    mark_sharded(p, Block.whole((3, 3)), (3, 3))
    p.grad = torch.ones(4, 3)
    p.grad[3] = JUNK
    q = nn.Parameter(torch.zeros(2))
    q.grad = torch.tensor([3.0, 4.0])
    assert_rel_close(grad_norm([p, q]), torch.tensor(math.sqrt(9 + 25)), 1e-6)
    assert float(grad_norm([p, q], "inf")) == 4.0
    assert float(grad_norm(q, 1)) == 7.0


def test_grad_norm_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="norm_type"):
        grad_norm([nn.Parameter(torch.zeros(1))], 0)
    with pytest.raises(TypeError, match="tensors"):
        grad_norm([1.0])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="max_norm"):
        clip_grad_norm_([nn.Parameter(torch.zeros(1))], -1.0)
