"""StaticPlacement fractions by bytes and AutoPlacement eviction by next use (fake chunks)."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from colossal.gemini import (
    AutoPlacement,
    Chunk,
    DeviceMemoryBudget,
    DeviceMemoryExceeded,
    MemStats,
    StaticPlacement,
    StepRecord,
)
from colossal.gemini.memory import ChunkLike


@dataclass(eq=False)
class FakeChunk:
    chunk_id: int
    payload_bytes: int
    shard_bytes: int = 0
    master_bytes: int = 0
    keep_gathered: bool = False
    requires_grad: bool = True
    is_gathered: bool = False


def _chunks(payloads: list[int], **kw: object) -> list[FakeChunk]:
    return [FakeChunk(i, p, p // 2, p, **kw) for i, p in enumerate(payloads)]  # type: ignore[arg-type]


def _sharded(plan: list) -> list[bool]:
    return [not p.keep_gathered for p in plan]


def test_static_shard_fraction_by_bytes_with_boundaries() -> None:
    chunks = _chunks([100, 300, 100, 500])  # total 1000, unequal sizes
    assert isinstance(chunks[0], ChunkLike)
    assert _sharded(StaticPlacement(0.0).plan(chunks)) == [False] * 4
    assert _sharded(StaticPlacement(1.0).plan(chunks)) == [True] * 4
    # Catches: fractions by chunk count (0.5 of 4 chunks = 2 chunks = 400 B, under half).
    assert _sharded(StaticPlacement(0.5).plan(chunks)) == [True, True, True, False]
    # Catches: off-by-one at an exact boundary (400 B reached by chunks 0-1 exactly: chunk 2
    # must not be sharded) and a fraction rounded down to zero chunks.
    assert _sharded(StaticPlacement(0.4).plan(chunks)) == [True, True, False, False]
    assert _sharded(StaticPlacement(0.41).plan(chunks)) == [True, True, True, False]
    assert _sharded(StaticPlacement(0.01).plan(chunks)) == [True, False, False, False]
    # A chunk the manager keeps gathered stays gathered; default placement is all on device.
    chunks[1].keep_gathered = True
    plan = StaticPlacement().plan(chunks)
    assert _sharded(plan) == [True, False, True, True]
    assert {(p.shard_location, p.master_location) for p in plan} == {("device", "device")}
    assert StaticPlacement().plan([]) == []


def test_static_offload_fractions() -> None:
    chunks = _chunks([100, 300, 100, 500])
    chunks[0].requires_grad = False  # frozen: no master/optimizer state
    chunks[0].master_bytes = 0
    plan = StaticPlacement(offload_optim_frac=0.4).plan(chunks)
    # trainable master bytes 300/100/500 (900): 0.4 -> 360 B -> chunks 1 and 2 (300 < 360).
    # Catches: a frozen chunk (no optimizer state) put on the host or counted in the bytes.
    assert [p.master_location for p in plan] == ["device", "host", "host", "device"]
    assert all(p.shard_location == "device" for p in plan)
    full = StaticPlacement(offload_optim_frac=1.0).plan(chunks)
    assert [p.master_location for p in full] == ["device", "host", "host", "host"]
    # Params offload needs shard 1 and optim 1: then shard bytes 50/150/50/250 -> 0.5 -> 250 B.
    plan = StaticPlacement(1.0, 1.0, 0.5).plan(chunks)
    assert [p.shard_location for p in plan] == ["host", "host", "host", "device"]
    assert [p.shard_location for p in StaticPlacement(1.0, 1.0, 1.0).plan(chunks)] == ["host"] * 4
    # Catches: offload_param_frac silently applied (or silently dropped) with shard < 1.
    with pytest.warns(UserWarning, match="offload_param_frac=0.5 is ignored"):
        policy = StaticPlacement(0.5, 1.0, 0.5)
    assert all(p.shard_location == "device" for p in policy.plan(chunks))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        StaticPlacement(1.0, 1.0, 0.5)  # valid combination: no warning


@pytest.mark.parametrize(
    ("kwargs", "exc", "needle"),
    [
        ({"shard_param_frac": 1.5}, ValueError, "shard_param_frac=1.5"),
        ({"offload_optim_frac": -0.1}, ValueError, "offload_optim_frac=-0.1"),
        ({"offload_param_frac": math.nan}, ValueError, "offload_param_frac=nan"),
        ({"shard_param_frac": "0.5"}, TypeError, "shard_param_frac"),
        ({"offload_optim_frac": True}, TypeError, "offload_optim_frac"),
    ],
)
def test_static_invalid_fractions_refused(kwargs: dict, exc: type, needle: str) -> None:
    # Catches: an out-of-range fraction accepted and silently clamped.
    with pytest.raises(exc, match=needle):
        StaticPlacement(**kwargs)


def _stats(uses_by_step: list[list[FakeChunk]], non_model: list[int]) -> MemStats:
    return MemStats(
        StepRecord(i, "forward", f"s{i}", 0, 0, nm, tuple(u))
        for i, (u, nm) in enumerate(zip(uses_by_step, non_model, strict=True))
    )


def test_auto_evicts_furthest_next_use_first_and_fits() -> None:
    a, b, c, d, e = (FakeChunk(i, 100, 100) for i in range(5))
    e.payload_bytes = 200
    # next use from step 1: a at 5, b never, c at 2, d at 9; e is needed at step 1.
    uses = [[a, b, c, d], [e], [c], [], [], [a], [], [], [], [d]]
    stats = _stats(uses, [450] * 10)
    policy = AutoPlacement(memstats=stats)
    budget = DeviceMemoryBudget(1000)
    budget.allocate("device", 400, "a-d shards")
    # limit = 1000 * 0.9 - 450 = 450; need 400 + 200 -> free 150 -> two 100 B chunks.
    assert policy.model_data_limit(1, budget) == 450
    evicted = policy.evictions([a, b, c, d], [e], 1, budget)
    # Catches: nearest-first (or list-order) eviction, evicting more than needed.
    assert [x.chunk_id for x in evicted] == [b.chunk_id, d.chunk_id]
    for x in evicted:
        budget.move("device", "host", 100, f"chunk {x.chunk_id}")
    assert budget.used("device") + 200 <= policy.model_data_limit(1, budget)  # fits after
    # Catches: evicting a chunk the step needs: c2 is never used in the trace (the furthest
    # next use of all) but is needed now, so it must stay.
    c2 = FakeChunk(9, 100, 100)
    budget2 = DeviceMemoryBudget(1000)
    budget2.allocate("device", 400, "c2 a b d")
    evicted = policy.evictions([c2, a, b, d], [c2, e], 1, budget2)
    assert [x.chunk_id for x in evicted] == [b.chunk_id, d.chunk_id]
    # Catches: an exact fit treated as overflow (250 + 200 == 450).
    budget3 = DeviceMemoryBudget(1000)
    budget3.allocate("device", 250, "x")
    assert policy.evictions([a, b, c], [e], 1, budget3) == []
    # Catches: a resident needed chunk charged its whole payload (it already holds its
    # 100 B shard: 350 + (200 - 100) == 450 fits).
    budget3.allocate("device", 100, "e shard")
    assert policy.evictions([a, b, e], [e], 1, budget3) == []
    assert [x.chunk_id for x in policy.evictions([a, b, e], [e], 1, budget3, demand=101)] == [1]
    assert policy.evictions([a], [e], 1, DeviceMemoryBudget(None)) == []  # unlimited


def test_auto_raises_when_nothing_can_fit() -> None:
    a, b, e = FakeChunk(0, 100, 100), FakeChunk(1, 100, 100), FakeChunk(7, 400, 200)
    stats = _stats([[a, b], [e]], [450, 450])
    budget = DeviceMemoryBudget(1000)
    budget.allocate("device", 260, "a, b and 60 B that cannot be evicted")
    # limit 1000 * 0.9 - 450 = 450; evicting a and b leaves 60 B: 60 + 400 > 450.
    with pytest.raises(DeviceMemoryExceeded) as err:
        AutoPlacement(memstats=stats).evictions([a, b], [e], 1, budget)
    exc = err.value
    # Catches: a silent overrun (returning every chunk and hoping), a message without need
    # and limit.
    assert (exc.needed, exc.in_use, exc.limit) == (400, 60, 450)
    assert "chunks [7] needed at step 1" in str(exc) and "450 B" in str(exc)
    # a step beyond the trace reserves the trace's peak
    assert AutoPlacement(memstats=_stats([[a]], [600])).model_data_limit(3, budget) == 300


def test_auto_warmup_uses_warmup_ratio_without_memstats() -> None:
    chunks = [FakeChunk(i, 100, 100) for i in range(4)]
    e = FakeChunk(9, 100, 100)
    budget = DeviceMemoryBudget(1000)
    budget.allocate("device", 400, "four chunks")
    warm = AutoPlacement(warmup_non_model_data_ratio=0.7)
    # Catches: the steady ratio or a trace used during warm-up; the ratio read as the model
    # share instead of the non-model share. Limit = 1000 * (1 - 0.7) = 300.
    assert warm.model_data_limit(0, budget) == 300
    evicted = warm.evictions(chunks, [e], 0, budget)
    assert [x.chunk_id for x in evicted] == [0, 1]  # given order, 400 + 100 - 300 = 200 B
    steady = warm.with_memstats(_stats([[e]], [100]))
    assert steady.model_data_limit(0, budget) == 800
    assert steady.evictions(chunks, [e], 0, budget) == []
    for bad in ({"steady_cuda_cap_ratio": 1.2}, {"warmup_non_model_data_ratio": -1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            AutoPlacement(**bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="MemStats"):
        AutoPlacement(memstats={"peak": 1})  # type: ignore[arg-type]
    plan = AutoPlacement().plan([FakeChunk(0, 10, 5, 10), FakeChunk(1, 10, 5, 0,
                                                                     requires_grad=False)])
    assert [(p.keep_gathered, p.shard_location, p.master_location) for p in plan] == [
        (False, "device", "host"), (False, "device", "device")]


def test_real_chunk_satisfies_chunk_like() -> None:
    # Catches: the policy's protocol drifting from the Chunk it places.
    budget = DeviceMemoryBudget(10**6)
    chunk = Chunk(64, None, torch.float16, budget=budget)
    chunk.append("w", nn.Parameter(torch.randn(4, 8)))
    chunk.close()
    assert isinstance(chunk, ChunkLike)
    (placement,) = StaticPlacement(1.0, 1.0, 1.0).plan([chunk])
    assert (placement.shard_location, placement.master_location) == ("host", "host")
