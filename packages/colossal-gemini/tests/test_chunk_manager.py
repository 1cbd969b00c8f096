"""ChunkManager: packing by kind, tied/frozen/large parameters, access/release, prefetch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from colossal.core import CommTracker
from colossal.core.testing import distributed_test
from colossal.gemini import ChunkManager, TensorState
from colossal.gemini.memory import ChunkPlacement, DeviceMemoryBudget, StaticPlacement


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 4)  # 200 elements: larger than the chunk size
        self.fc1 = nn.Linear(4, 8)
        self.frozen = nn.Linear(8, 7)
        self.frozen.requires_grad_(False)
        self.fc2 = nn.Linear(7, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 50, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(self.emb(idx)))
        h = self.fc2(torch.tanh(self.frozen(h)))
        return self.head(self.norm(h))


def _register(model: nn.Module, manager: ChunkManager, dtype: torch.dtype) -> None:
    # named_parameters(remove_duplicate=False) yields the tied weight twice, as a hook would.
    for name, p in model.named_parameters(remove_duplicate=False):
        keep = name.startswith("norm.")
        manager.register(name, p, dtype=torch.float32 if keep else dtype, keep_gathered=keep)
    manager.close_all()


def test_packing_kinds_in_one_process() -> None:
    torch.manual_seed(0)
    model = Tiny()
    budget = DeviceMemoryBudget()
    manager = ChunkManager(64, None, budget=budget)
    _register(model, manager, torch.bfloat16)
    by_name = {manager.name_of(p): manager.chunk_of(p) for c in manager.chunks for p in c.params}
    emb = by_name["emb.weight"]
    # Catches a parameter larger than the chunk size overflowing or being split.
    assert emb.params == [model.emb.weight] and emb.chunk_size == 200
    # Catches a tied weight stored twice (two copies that drift apart).
    assert manager.chunk_of(model.head.weight) is emb and "head.weight" not in by_name
    assert sum(len(c.params) for c in manager.chunks) == len(list(model.parameters()))
    # Catches frozen parameters sharing a chunk with trainable ones (and getting masters).
    frozen = by_name["frozen.weight"]
    assert by_name["frozen.bias"] is frozen and not frozen.requires_grad
    assert frozen.master is None and all(not p.requires_grad for p in frozen.params)
    assert all(p.requires_grad for c in manager.chunks if c.requires_grad for p in c.params)
    # fc1 (40 elements) + fc2.weight (28) exceed 64: fc2.weight opens the next chunk, and
    # the frozen layer between them does not interfere (catches one open chunk for all).
    assert by_name["fc1.weight"] is by_name["fc1.bias"]
    assert by_name["fc2.weight"] is not by_name["fc1.weight"]
    assert by_name["fc2.weight"] is by_name["fc2.bias"]
    assert by_name["fc1.weight"].chunk_size == 40
    norm = by_name["norm.weight"]
    assert norm.keep_gathered and norm.dtype == torch.float32 and norm is by_name["norm.bias"]
    assert norm.chunk_size == 8  # trimmed to its content
    assert [c.chunk_id for c in manager.chunks] == list(range(len(manager.chunks)))
    assert manager.memory() == {"device": budget.used("device"), "host": budget.used("host")}

    with pytest.raises(KeyError, match=r"shape \(3,\).*register"):
        manager.chunk_of(nn.Parameter(torch.ones(3)))
    with pytest.raises(ValueError, match="'fc1.weight'"):
        manager.register("fc1.weight", nn.Parameter(torch.ones(3)), dtype=torch.float32)
    other = ChunkManager(64, None)
    other.register("a", nn.Parameter(torch.ones(4)), dtype=torch.float32, group_key="g0")
    other.register("b", nn.Parameter(torch.ones(4)), dtype=torch.float32, group_key="g1")
    other.register("c", nn.Parameter(torch.ones(4)), dtype=torch.float16, group_key="g1")
    assert len(other.chunks) == 3  # param groups and dtypes never share a chunk
    with pytest.raises(ValueError, match="max_prefetch"):
        ChunkManager(64, None, max_prefetch=-1)


def test_layout_plans_what_register_builds_and_set_plan_places_it() -> None:
    """``layout`` (no allocation) predicts every chunk ``register`` builds, and a plan given
    with ``set_plan`` is applied while building (masters and shards born on the host).

    Catches a layout that drifts from the packing rules (a plan applied to the wrong chunks)
    and chunks built on the device first and moved after (a device peak above the plan).
    """
    torch.manual_seed(0)
    model = Tiny()
    named = list(model.named_parameters(remove_duplicate=False))
    probe = ChunkManager(64, None)
    specs = probe.layout(named, dtype=torch.bfloat16)
    assert probe.chunks == [] and [s.chunk_id for s in specs] == list(range(len(specs)))
    budget = DeviceMemoryBudget()
    manager = ChunkManager(64, None, budget=budget)
    plan = StaticPlacement(offload_optim_frac=1.0, offload_param_frac=1.0).plan(specs)
    manager.set_plan(plan)
    for name, p in named:
        manager.register(name, p, dtype=torch.bfloat16)
    manager.close_all()
    got = [(c.payload_bytes, c.shard_bytes, c.master_bytes, c.requires_grad)
           for c in manager.chunks]
    assert got == [(s.payload_bytes, s.shard_bytes, s.master_bytes, s.requires_grad)
                   for s in specs]
    assert all(c.shard_location == "host" for c in manager.chunks)
    assert all(c.master_location == "host" for c in manager.chunks if c.requires_grad)
    assert budget.used("device") == 0
    # Only the chunk being filled (and its trimmed copy) was ever on the device.
    assert budget.peak("device") <= 2 * max(s.payload_bytes for s in specs)
    with pytest.raises(RuntimeError, match="already has chunks"):
        manager.layout(named, dtype=torch.bfloat16)
    # Boundaries: exact fills, a parameter of exactly the chunk size, one just over it.
    sizes = [30, 34, 64, 65, 1, 63, 2, 5, 64]
    params = [(f"p{i}", nn.Parameter(torch.ones(n), requires_grad=i % 4 != 3))
              for i, n in enumerate(sizes)]
    specs = ChunkManager(64, None).layout(params, dtype=torch.float16)
    built = ChunkManager(64, None)
    for name, p in params:
        built.register(name, p, dtype=torch.float16)
    built.close_all()
    assert [(s.payload_bytes, s.requires_grad) for s in specs] == \
        [(c.payload_bytes, c.requires_grad) for c in built.chunks]


@distributed_test(2)
def test_access_release_prefetch(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    reference = Tiny()
    model = Tiny()
    model.load_state_dict(reference.state_dict())
    budget = DeviceMemoryBudget()
    manager = ChunkManager(64, None, budget=budget, max_prefetch=2)
    _register(model, manager, torch.float32)
    chunks = manager.chunks
    sharded = [c for c in chunks if not c.keep_gathered]
    assert len(sharded) >= 4 and all(not c.is_gathered for c in sharded)
    at_rest = budget.used("device")

    with CommTracker() as t:
        for c in chunks:
            manager.access(c)
    # Catches gathering kept-gathered chunks, or more than one all-gather per chunk.
    assert t.calls("all_gather") == len(sharded) and t.calls() == len(sharded)
    assert manager.accessed == chunks
    idx = torch.tensor([[1, 7, 49], [0, 3, 3]])
    with torch.no_grad():
        # Every rank holds the whole model again, bit-for-bit.
        assert torch.equal(model(idx), reference(idx))
    for c in chunks:
        manager.release(c)
    assert budget.used("device") == at_rest and manager.accessed == []
    assert all(c.states()[TensorState.FREE] == len(c.params) for c in sharded)

    with CommTracker() as t:
        manager.prefetch(chunks)
    # Catches prefetching beyond max_prefetch (device memory) or kept-gathered chunks.
    assert t.calls("all_gather") == 2 and manager.in_flight == sharded[:2]
    with CommTracker() as t:
        manager.access(sharded[0])  # completes its prefetch: no new collective
        manager.access(sharded[1])
        manager.access(sharded[2])
    assert t.calls("all_gather") == 1 and manager.in_flight == []
    for c in sharded[:3]:
        for p in c.params:
            assert torch.equal(p.data, reference.get_parameter(manager.name_of(p)).data)
        manager.release(c)
    assert budget.used("device") == at_rest

    # Placement: keep the first sharded chunk gathered, offload the second one's shard and
    # master; then go back to the original placement.
    original = [ChunkPlacement(c.keep_gathered, c.shard_location, c.master_location)
                for c in chunks]
    plan = list(original)
    first, second = sharded[0].chunk_id, sharded[1].chunk_id
    plan[first] = ChunkPlacement(True, "device", "device")
    plan[second] = ChunkPlacement(False, "host", "host")
    with CommTracker() as t:
        manager.apply_placement(plan)
    # Catches a switched chunk not gathered (or gathered twice), or bytes left unaccounted.
    assert t.calls("all_gather") == 1 and t.calls() == 1
    assert sharded[0].keep_gathered and sharded[0].is_gathered
    for p in sharded[0].params:
        assert torch.equal(p.data, reference.get_parameter(manager.name_of(p)).data)
    assert budget.used("host") == sharded[1].shard_bytes + sharded[1].master_bytes
    assert manager.memory() == {"device": budget.used("device"), "host": budget.used("host")}
    with CommTracker() as t:
        manager.apply_placement(original)
    assert t.calls() == 0 and not sharded[0].is_gathered and not sharded[0].keep_gathered
    assert (budget.used("device"), budget.used("host")) == (at_rest, 0)
    with pytest.raises(ValueError, match="plan every chunk"):
        manager.apply_placement(original[:-1])

    # A static plan (half the bytes kept gathered, optimizer side offloaded) still computes
    # the reference model.
    manager.apply_placement(StaticPlacement(shard_param_frac=0.5, offload_optim_frac=1.0)
                            .plan(manager.chunks))
    for c in chunks:
        manager.access(c)
    with torch.no_grad():
        assert torch.equal(model(idx), reference(idx))
    assert manager.memory() == {"device": budget.used("device"), "host": budget.used("host")}
