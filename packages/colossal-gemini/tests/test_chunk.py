"""Chunk: packing, sharding, gather/release, gradient reduction, masters, moves, budget."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from colossal.core import CommTracker
from colossal.core.testing import distributed_test
from colossal.gemini import Chunk, TensorState
from colossal.gemini.memory import DeviceMemoryBudget, DeviceMemoryExceeded

SHAPES = [(3, 5), (7,), (4, 4), (1,)]  # 39 elements: padded at world 2 and 4


def _originals(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _build(origs, dtype, world, **kw) -> tuple[Chunk, list[nn.Parameter]]:
    params = [nn.Parameter(o.clone()) for o in origs]
    chunk = Chunk(64, None, dtype, **kw)
    for i, p in enumerate(params):
        chunk.append(f"p{i}", p)
    chunk.close()
    return chunk, params


def _padded(origs, size: int) -> torch.Tensor:
    flat = torch.cat([o.reshape(-1) for o in origs])
    return torch.cat([flat, flat.new_zeros(size - flat.numel())])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_chunk_with_fp32_master(dtype: torch.dtype) -> None:
    origs = _originals()
    budget = DeviceMemoryBudget()
    chunk, params = _build(origs, dtype, 1, budget=budget)
    n = 39
    assert chunk.chunk_size == n and chunk.numel == n and not chunk.is_gathered
    assert chunk.states()[TensorState.FREE] == 4
    # Catches the master being taken from the low-precision cast instead of the originals.
    assert chunk.master is not None and chunk.master.dtype == torch.float32
    assert torch.equal(chunk.master, _padded(origs, n))
    assert torch.equal(chunk.shard, _padded(origs, n).to(dtype))
    for p, o in zip(params, origs, strict=True):
        start, stop, view = chunk.tensor_shard(p, "master")
        assert (start, stop) == (0, o.numel()) and torch.equal(view, o.reshape(-1))
    # Budget: released chunk = shard (2 B) + master (4 B) per element, all on the device.
    assert budget.used("device") == n * 6 and budget.used("host") == 0
    assert chunk.memory() == {"device": n * 6, "host": 0}
    # Released parameters are empty (catches a released parameter still reading the payload).
    assert params[0].shape == (0,) and params[0].dtype == dtype
    with pytest.raises(RuntimeError):
        torch.nn.functional.linear(torch.ones(2, 5, dtype=dtype), params[0])
    chunk.gather()
    assert budget.used("device") == n * 8 and budget.peak("device") >= n * 8
    for p, o in zip(params, origs, strict=True):
        assert p.dtype == dtype and torch.equal(p.data, o.to(dtype))
    chunk.release()
    # Catches a release that forgets to return the payload's bytes.
    assert budget.used("device") == n * 6

    chunk.move_shard("host")
    assert (budget.used("device"), budget.used("host")) == (n * 4, n * 2)
    chunk.move_master("host")
    assert (budget.used("device"), budget.used("host")) == (0, n * 6)
    assert chunk.shard_location == chunk.master_location == "host"
    chunk.gather()  # from a host shard
    assert torch.equal(params[1].data, origs[1].to(dtype)) and budget.used("device") == n * 2
    chunk.master.add_(1.0)  # an "optimizer step"
    chunk.update_shard_from_master()
    # Catches the cast missing, or a stale gathered payload surviving the update.
    assert not chunk.is_gathered and budget.used("device") == 0
    assert torch.equal(chunk.shard, (_padded(origs, n) + 1).to(dtype))
    chunk.move_shard("device")
    chunk.move_master("device")
    assert (budget.used("device"), budget.used("host")) == (n * 6, 0)
    with pytest.raises(ValueError, match="'device' or 'host'"):
        chunk.move_shard("cuda")  # type: ignore[arg-type]


def test_fp32_chunk_has_no_separate_master() -> None:
    chunk, params = _build(_originals(), torch.float32, 1)
    assert chunk.master is None and chunk.optim_shard is chunk.shard and chunk.master_bytes == 0


def test_budget_limit_refuses_gather_cleanly() -> None:
    budget = DeviceMemoryBudget(capacity=39 * 6 + 10)
    chunk, _ = _build(_originals(), torch.float16, 1, budget=budget)
    # Catches an over-limit gather allocating anyway (a silent overrun).
    with pytest.raises(DeviceMemoryExceeded, match="chunk 0 payload"):
        chunk.gather()
    assert not chunk.is_gathered and budget.used("device") == 39 * 6
    assert chunk.states()[TensorState.FREE] == 4


def test_append_misuse() -> None:
    chunk = Chunk(10, None, torch.float32)
    with pytest.raises(TypeError, match="floating-point"):
        chunk.append("idx", torch.arange(3))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="requires_grad=False.*separate chunks"):
        chunk.append("frozen", nn.Parameter(torch.ones(2), requires_grad=False))
    p = nn.Parameter(torch.ones(8))
    chunk.append("a", p)
    with pytest.raises(ValueError, match="'a2' is already in it as 'a'"):
        chunk.append("a2", p)
    with pytest.raises(ValueError, match="'b' \\(3 elements\\) does not fit"):
        chunk.append("b", nn.Parameter(torch.ones(3)))
    chunk.close()
    with pytest.raises(ValueError, match="closed"):
        chunk.append("c", nn.Parameter(torch.ones(1)))
    with pytest.raises(ValueError, match="positive int"):
        Chunk(0, None, torch.float32)
    with pytest.raises(TypeError, match="floating"):
        Chunk(4, None, torch.int32)


def _grads(rank: int, used: bool) -> list[torch.Tensor | None]:
    # Multiples of 1/4 below 8: sums and halvings are exact in fp16, so averages compare
    # bit-for-bit. The last parameter is unused on rank 0.
    g = torch.Generator().manual_seed(100 + rank)
    out: list[torch.Tensor | None] = [
        torch.randint(-32, 32, s, generator=g).float() / 4 for s in SHAPES
    ]
    if not used:
        out[-1] = None
    return out


def _expected_avg(world: int, size: int) -> torch.Tensor:
    total = torch.zeros(size)
    for r in range(world):
        grads = [g if g is not None else torch.zeros(s) for g, s in
                 zip(_grads(r, r != 0), SHAPES, strict=True)]
        total += _padded(grads, size)
    return total / world


def _check_sharded(rank: int, world: int) -> None:
    origs = _originals()
    budget = DeviceMemoryBudget()
    chunk, params = _build(origs, torch.float16, world, budget=budget)
    size = -(-39 // world) * world
    n = size // world
    lo, hi = rank * n, (rank + 1) * n
    assert chunk.chunk_size == size and chunk.shard_size == n
    assert (chunk.shard_begin, chunk.shard_end) == (lo, hi)
    # Each rank keeps only its slice (catches a rank keeping the wrong or the whole chunk).
    assert torch.equal(chunk.shard, _padded(origs, size)[lo:hi].half())
    assert torch.equal(chunk.master, _padded(origs, size)[lo:hi])
    for p, o in zip(params, origs, strict=True):
        info = chunk.infos[p]
        start, stop, view = chunk.tensor_shard(p)
        assert start == min(max(lo - info.offset, 0), o.numel())
        assert chunk.shard_range(p) == (start, stop)  # the same range, without the view
        assert torch.equal(view, o.reshape(-1)[start:stop].half())
    assert budget.used("device") == n * 6

    with CommTracker() as t:
        chunk.gather()
        chunk.gather()  # already gathered: nothing
    # Catches a missing or a per-tensor gather: one all-gather per chunk gather.
    one = int(world > 1)  # world 1 issues no collective
    assert t.calls("all_gather") == one and t.calls() == one
    for p, o in zip(params, origs, strict=True):
        assert torch.equal(p.data, o.half())  # bit-for-bit
    assert budget.used("device") == n * 6 + size * 2

    grads = _grads(rank, rank != 0)
    for p, g in zip(params, grads, strict=True):
        chunk.set_state(p, TensorState.COMPUTE)
        chunk.set_state(p, TensorState.HOLD_AFTER_BWD)
        if g is not None:
            chunk.copy_grad(p, g)
    assert chunk.all_grads_ready() == (rank != 0)
    assert budget.used("device") == n * 6 + size * 4  # + the fp16 gradient buffer
    with CommTracker() as t:
        chunk.reduce()
    # Catches per-tensor reductions, a missing one on the rank without the last gradient,
    # or averaging by the wrong count.
    assert t.calls("reduce_scatter") == one and t.calls() == one
    expected = _expected_avg(world, size)[lo:hi]
    # The reduced shard keeps the chunk dtype (2 bytes per element, the ZeRO-3 formula's
    # gradient term; catches an fp32 gradient shard, 2 bytes more per element).
    assert chunk.grad_shard.dtype == torch.float16
    assert torch.equal(chunk.grad_shard.float(), expected)
    assert chunk.states()[TensorState.HOLD] == 4
    # The gradient buffer is freed; the fp16 gradient shard is kept.
    assert budget.used("device") == n * 8 + size * 2 == chunk.memory()["device"]
    kinds = chunk.memory_by_kind()
    assert kinds["param_shards"]["device"] == 2 * n and kinds["masters"]["device"] == 4 * n
    assert kinds["grad_shards"]["device"] == 2 * n and kinds["grad_buffers"]["device"] == 0
    assert kinds["gathered_params"]["device"] == 2 * size

    for p, g in zip(params, grads, strict=True):
        if g is not None:
            chunk.copy_grad(p, g)
    chunk.reduce(accumulate=True)
    assert torch.equal(chunk.grad_shard, 2 * expected)  # gradient accumulation
    for p, g in zip(params, grads, strict=True):
        if g is not None:
            chunk.copy_grad(p, g)
    chunk.reduce(average=False)
    assert torch.equal(chunk.grad_shard, expected * world)
    chunk.free_grad_shard()

    chunk.master.add_(rank + 1)
    chunk.update_shard_from_master()
    assert not chunk.is_gathered and budget.used("device") == n * 6
    work = chunk.gather(async_op=True)
    assert (work is not None) == (world > 1) and chunk.is_gathered
    chunk.wait()
    step = torch.cat([torch.full((n,), float(r + 1)) for r in range(world)])
    assert torch.equal(chunk.payload, (_padded(origs, size) + step).half())

    # grad_dtype=fp32 (gradient accumulation): the reduced shard is fp32, 4 bytes.
    chunk, params = _build(origs, torch.float16, world, grad_dtype=torch.float32)
    chunk.gather()
    for p, g in zip(params, grads, strict=True):
        chunk.set_state(p, TensorState.COMPUTE)
        chunk.set_state(p, TensorState.HOLD_AFTER_BWD)
        if g is not None:
            chunk.copy_grad(p, g)
    chunk.reduce()
    assert chunk.grad_shard.dtype == torch.float32 and torch.equal(chunk.grad_shard, expected)


def _check_keep_gathered(rank: int, world: int) -> None:
    origs = _originals(1)
    budget = DeviceMemoryBudget()
    chunk, params = _build(origs, torch.float32, world, keep_gathered=True, budget=budget)
    size = chunk.chunk_size
    n = size // world
    one = int(world > 1)  # world 1 issues no collective
    assert budget.used("device") == size * 4  # the shard is a view of the payload
    with CommTracker() as t:
        chunk.gather()
        chunk.release()  # no-op: stays gathered
        grads = _grads(rank, rank != 0)
        for p, g in zip(params, grads, strict=True):
            if g is not None:
                chunk.copy_grad(p, g)
        chunk.reduce()
    # Catches a kept-gathered chunk being gathered again or reduce-scattered.
    assert t.calls("all_reduce") == one and t.calls() == one
    assert torch.equal(chunk.grad_shard, _expected_avg(world, size)[rank * n : (rank + 1) * n])
    chunk.optim_shard.add_(rank + 1)
    with CommTracker() as t:
        chunk.update_shard_from_master()
    # Catches the other ranks' slices staying stale in a kept-gathered payload.
    assert t.calls("all_gather") == one
    step = torch.cat([torch.full((n,), float(r + 1)) for r in range(world)])
    assert torch.equal(chunk.payload, _padded(origs, size) + step)
    with pytest.raises(ValueError, match="keep_gathered"):
        chunk.move_shard("host")


@distributed_test(2, 4)
def test_sharded_chunk_collectives(rank: int, world_size: int) -> None:
    _check_sharded(rank, world_size)
    _check_keep_gathered(rank, world_size)


def test_single_process_chunk() -> None:
    # World 1 without a process group: no collective, same results.
    _check_sharded(0, 1)
    _check_keep_gathered(0, 1)


def test_views_saved_by_autograd_see_the_regathered_payload() -> None:
    torch.manual_seed(0)
    w = torch.randn(3, 5)
    p = nn.Parameter(w.clone())
    chunk = Chunk(16, None, torch.float32)
    chunk.append("w", p)
    chunk.close()
    chunk.gather()
    x = torch.randn(2, 5, requires_grad=True)
    y = x @ p.t()  # autograd saves the view p.t() of the payload for x.grad
    chunk.release()  # between forward and backward, as ZeRO-3 does
    chunk.gather()
    y.pow(2).sum().backward()
    x_ref = x.detach().clone().requires_grad_(True)
    (x_ref @ w.t()).pow(2).sum().backward()
    # Catches a gather into a new buffer: the saved view would keep the old storage.
    assert torch.equal(x.grad, x_ref.grad)
