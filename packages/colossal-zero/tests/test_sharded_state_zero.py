"""ZeRO's sharded optimizer states implement colossal.core's sharded-state protocol."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from zero_testlib import batch, local, loss_fn, make_model, make_optimizer

from colossal.core import FlatRange, LocalShard, ShardedTensor
from colossal.core.testing import distributed_test
from colossal.zero import LowLevelZeroOptimizer, StateRef, sharded_params, sharded_state_dict

STEPS = 2


def _train(model: torch.nn.Module, opt: object, rank: int, world_size: int) -> None:
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        if isinstance(opt, LowLevelZeroOptimizer):
            opt.backward(loss_fn(model, local(x, rank, world_size), local(y, rank, world_size)))
        else:
            loss_fn(model, x, y).backward()
        opt.step()


def _zero(rank: int, world_size: int) -> tuple[torch.nn.Module, LowLevelZeroOptimizer]:
    model = make_model()
    # 40-element buckets: most parameters straddle the two ranks' slices.
    opt = LowLevelZeroOptimizer(make_optimizer(model), partition_grad=True, reduce_bucket_size=40)
    _train(model, opt, rank, world_size)
    return model, opt


def _refs(opt: LowLevelZeroOptimizer) -> list[tuple[int, str, StateRef]]:
    return [
        (i, name, ref)
        for i, entry in sharded_state_dict(opt)["state"].items()
        for name, ref in entry.items()
        if isinstance(ref, StateRef)
    ]


@distributed_test(2)
def test_zero_state_gathers_to_the_single_process_state(rank: int, world_size: int) -> None:
    # Catches: a part that names other elements than local() holds, a gather that reaches the
    # wrong rank or reassembles the parts in the wrong order.
    model, opt = _zero(rank, world_size)
    reference_model = make_model()
    reference_opt = make_optimizer(reference_model)
    _train(reference_model, reference_opt, 0, 1)
    expected = reference_opt.state_dict()["state"]
    refs = _refs(opt)
    assert {name for _, name, _ in refs} == {"exp_avg", "exp_avg_sq"}
    straddling = 0
    for i, name, ref in refs:
        assert isinstance(ref, ShardedTensor) and isinstance(ref.part, FlatRange)
        assert ref.shape == expected[i][name].shape and ref.dtype == torch.float32
        held = torch.tensor([ref.part.numel])
        dist.all_reduce(held)
        assert held.item() == ref.shape.numel()  # the ranks' parts tile the parameter
        straddling += 0 < ref.part.numel < ref.shape.numel()
        for dst in range(world_size):
            full = ref.gather(dst)
            if rank != dst:
                assert full is None
                continue
            torch.testing.assert_close(full, expected[i][name], rtol=1e-5, atol=1e-7)
            assert torch.equal(ref.part.take(full), ref.local()), (i, name)
    assert straddling > 0
    with pytest.raises(ValueError, match="dst=7"):
        refs[0][2].gather(7)


@distributed_test(2)
def test_zero_loads_local_parts_through_the_protocol(rank: int, world_size: int) -> None:
    # Catches: a loader that places a part at the wrong offset of the rank's slice, or that
    # accepts a part not covering what the rank keeps.
    _, opt = _zero(rank, world_size)
    saved = opt.state_dict()  # full states (collective)
    model = make_model()
    fresh = LowLevelZeroOptimizer(make_optimizer(model), partition_grad=True, reduce_bucket_size=40)
    layouts = sharded_params(fresh)
    assert sorted(layouts) == sorted(saved["state"])
    parts = {}
    for i, entries in saved["state"].items():
        layout = layouts[i]
        assert layout.shape == entries["exp_avg"].shape
        parts[i] = {
            k: LocalShard(layout.part.take(v).clone(), layout.part, v.shape)
            if isinstance(v, torch.Tensor) and v.dim() > 0
            else v
            for k, v in entries.items()
        }
    fresh.load_state_dict({**saved, "state": parts})
    loaded = fresh.state_dict()
    for i, entries in saved["state"].items():
        for k, v in entries.items():
            assert torch.equal(loaded["state"][i][k], v), (i, k)

    # A part that misses elements this rank keeps is refused, naming both.
    i = next(i for i, layout in layouts.items() if layout.part.numel > 1)
    part = layouts[i].part
    short = FlatRange(part.start, part.stop - 1)
    exp_avg = saved["state"][i]["exp_avg"]
    bad_part = LocalShard(short.take(exp_avg).clone(), short, exp_avg.shape)
    bad = {**saved["state"], i: {**saved["state"][i], "exp_avg": bad_part}}
    with pytest.raises(ValueError, match="needs FlatRange"):
        fresh.load_state_dict({**saved, "state": bad})
