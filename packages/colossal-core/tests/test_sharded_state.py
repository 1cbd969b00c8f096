"""The sharded-state protocol: parts, reading only a part, and gathering to a named rank."""

from __future__ import annotations

import pytest
import torch

from colossal.core import (
    Block,
    Blocks,
    FlatRange,
    LocalShard,
    OptimizerWrapper,
    Replicated,
    ShardedTensor,
    mark_sharded,
    shard_parameter,
    shard_source,
    shard_spec,
    sharded_view,
)
from colossal.core.testing import distributed_test

SHAPE = (5, 3)  # 15 elements: split unevenly over 2 ranks


def _full() -> torch.Tensor:
    return torch.arange(15, dtype=torch.float32).reshape(SHAPE) * 1.5 - 4


def _reader(full: torch.Tensor, seen: list[object]):  # noqa: ANN202 - a SliceReader
    def read(index: tuple[slice, ...] | None) -> torch.Tensor:
        seen.append(index)
        return full if index is None else full[index]

    return read


# ---- parts -----------------------------------------------------------------------------------
def test_flat_range_reads_only_the_rows_covering_it() -> None:
    # Catches: reading the whole tensor for a part, or an off-by-one at either end of a row.
    full = _full()
    for start, stop in [(0, 15), (4, 11), (3, 6), (7, 7), (14, 15), (0, 1)]:
        seen: list[object] = []
        got = FlatRange(start, stop).read(_reader(full, seen), SHAPE)
        assert torch.equal(got, full.reshape(-1)[start:stop]), (start, stop)
        if (start, stop) != (0, 15):
            (index,) = seen
            rows = index[0]
            assert rows.start == start // 3 and rows.stop == -(-stop // 3) or start == stop


def test_block_reads_exactly_its_box_and_puts_it_back() -> None:
    # Catches: a block index that mixes offsets and sizes, or put/take at the wrong place.
    full = _full()
    block = Block((1, 1), (3, 2))
    seen: list[object] = []
    got = block.read(_reader(full, seen), SHAPE)
    assert torch.equal(got, full[1:4, 1:3]) and seen == [(slice(1, 4), slice(1, 3))]
    out = torch.zeros(SHAPE)
    block.put(out, got)
    assert torch.equal(out[1:4, 1:3], full[1:4, 1:3]) and out.sum() == full[1:4, 1:3].sum()
    assert Block.along(SHAPE, 0, 3, 5) == Block((3, 0), (2, 3))
    assert Block.whole(SHAPE).read(_reader(full, seen), SHAPE) is full  # no slicing at all


def test_padded_local_tensor_holds_its_part_in_front() -> None:
    # A vocabulary padded for tensor parallelism: rank 1 holds rows 3..5 of 5 in a 3-row buffer.
    part = Block.along(SHAPE, 0, 3, 5)
    padded = torch.full((3, 3), float("nan"))
    padded[:2] = _full()[3:5]
    shard = LocalShard(padded, part, SHAPE)
    assert torch.equal(part.real(shard.local()), _full()[3:5])


def test_bad_parts_are_refused() -> None:
    with pytest.raises(ValueError, match="one entry per dim"):
        Block((0,), (1, 2))
    with pytest.raises(ValueError, match=">= 0"):
        Block((0, -1), (1, 2))
    with pytest.raises(ValueError, match="start <= stop"):
        FlatRange(5, 3)
    with pytest.raises(ValueError, match="does not fit"):
        FlatRange(10, 16).check(SHAPE)
    with pytest.raises(ValueError, match="does not fit"):
        LocalShard(torch.zeros(2, 3), Block((4, 0), (2, 3)), SHAPE)
    with pytest.raises(ValueError, match="cannot hold"):
        LocalShard(torch.zeros(3), FlatRange(0, 4), SHAPE)
    with pytest.raises(TypeError, match="Block, Blocks or FlatRange"):
        LocalShard(torch.zeros(3), (0, 3), SHAPE)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="torch.Tensor"):
        Replicated([1.0])  # type: ignore[arg-type]


def test_implementations_satisfy_the_protocol() -> None:
    full = _full()
    for shard in (Replicated(full), LocalShard(full.reshape(-1)[2:9], FlatRange(2, 9), SHAPE)):
        assert isinstance(shard, ShardedTensor)
        assert shard.shape == torch.Size(SHAPE) and shard.dtype == torch.float32
    assert not isinstance(full, ShardedTensor)  # a plain tensor is wrapped, not mistaken
    assert Replicated(full).gather(0) is full  # world 1: no copy, no communication
    assert torch.equal(LocalShard(full, Block.whole(SHAPE), SHAPE).gather(), full)


def test_protocol_check_is_decided_per_type() -> None:
    """isinstance against ShardedTensor is cached per type (a per-call member lookup cost
    milliseconds per save): the cache must not turn a type's answer into another type's
    (catches a cache keyed on something coarser than the type, or stored where typing counts
    it as a member of the protocol, which makes every check False)."""

    class Partial:  # shape, dtype, placements, part, local but no gather: not one
        shape, dtype, part = torch.Size(SHAPE), torch.float32, FlatRange(0, 1)
        placements = ()

        def local(self) -> torch.Tensor:
            return torch.zeros(1)

    class Whole(Partial):
        def gather(self, dst: int | None = None) -> torch.Tensor:
            return torch.zeros(SHAPE)

    for _ in range(2):  # the first check fills the cache, the second reads it
        assert not isinstance(Partial(), ShardedTensor)
        assert isinstance(Whole(), ShardedTensor)
        assert isinstance(Replicated(_full()), ShardedTensor)
        assert not isinstance(_full(), ShardedTensor) and not isinstance(1.0, ShardedTensor)


# ---- gather to a named rank (world 2) ---------------------------------------------------------
def _shards(rank: int) -> dict[str, object]:
    full = _full()
    rows = Block.along(SHAPE, 0, 0, 3) if rank == 0 else Block.along(SHAPE, 0, 3, 5)
    flat = FlatRange(0, 7) if rank == 0 else FlatRange(7, 15)  # splits row 2
    return {
        "replicated": Replicated(full),
        "rows": LocalShard(rows.take(full).clone(), rows, SHAPE),
        "flat": LocalShard(flat.take(full).clone(), flat, SHAPE),
    }


@distributed_test(2)
def test_gather_to_a_named_rank(rank: int, world_size: int) -> None:
    # Catches: parts placed at the wrong offsets, a part sent to the wrong rank, or every rank
    # receiving the tensor when only dst should.
    from colossal.core import CommTracker

    full = _full()
    for kind, shard in _shards(rank).items():
        for dst in range(world_size):
            with CommTracker() as tracker:
                got = shard.gather(dst)
            if rank == dst:
                assert got is not None and torch.equal(got, full), (kind, dst)
            else:
                assert got is None, (kind, dst)
            if kind == "replicated":
                assert tracker.calls() == 0
            elif rank != dst:  # sends its own part once, receives nothing
                assert tracker.calls("recv") == 0 and tracker.calls("broadcast") == 0
                assert tracker.bytes("send") == shard.part.numel * 4, (kind, dst)
        everywhere = shard.gather(None)
        assert everywhere is not None and torch.equal(everywhere, full), kind


@distributed_test(2)
def test_gather_refuses_bad_input(rank: int, world_size: int) -> None:
    shard = _shards(rank)["rows"]
    with pytest.raises(ValueError, match="dst=5"):
        shard.gather(5)
    half = Block.along(SHAPE, 0, 0, 3)  # both ranks hold the same rows: 2 rows held by nobody
    gap = LocalShard(half.take(_full()).clone(), half, SHAPE)
    with pytest.raises(ValueError, match="6 of 15 elements"):
        gap.gather(None)


# ---- parameter names on the optimizer wrapper --------------------------------------------------
def _optimizer() -> torch.optim.Optimizer:
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return torch.optim.SGD([{"params": weights}, {"params": biases}], lr=0.1)


def test_optimizer_wrapper_carries_validated_param_names() -> None:
    names = [["0.weight", "1.weight"], ["0.bias", "1.bias"]]
    opt = OptimizerWrapper(_optimizer(), param_names=names)
    assert opt.param_names == (("0.weight", "1.weight"), ("0.bias", "1.bias"))
    assert OptimizerWrapper(_optimizer()).param_names is None
    # Names are counted against the groups as wrapped, even if a subclass replaces them later.
    opt.optim.param_groups[0]["params"] = opt.optim.param_groups[0]["params"][:1]
    opt.set_param_names(names)
    with pytest.raises(ValueError, match=r"\(2, 1\) names per group .* \(2, 2\)"):
        OptimizerWrapper(_optimizer(), param_names=[names[0], ["0.bias"]])
    with pytest.raises(ValueError, match="per group"):
        OptimizerWrapper(_optimizer(), param_names=[names[0]])
    with pytest.raises(ValueError, match=r"repeats \['0.weight'\]"):
        OptimizerWrapper(_optimizer(), param_names=[names[0], ["0.weight", "1.bias"]])
    with pytest.raises(TypeError, match="non-empty strings"):
        OptimizerWrapper(_optimizer(), param_names=[names[0], ["0.bias", 3]])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="one sequence of names per param group"):
        OptimizerWrapper(_optimizer(), param_names="0.weight")


# ---- several blocks (fused projections) and marked tensors -----------------------------------
FUSED = (2, 12)  # three segments of 4 columns: rank r of 2 holds columns [2r, 2r+2) of each


def _fused_part(rank: int) -> Blocks:
    return Blocks(
        1, tuple(Block.along(FUSED, 1, 4 * s + 2 * rank, 4 * s + 2 * rank + 2) for s in range(3))
    )


def test_blocks_take_put_and_read_round_trip() -> None:
    # Catches: segments concatenated in the wrong order or along the wrong dim, or a reader
    # asked for the whole tensor instead of each block.
    full = torch.arange(24, dtype=torch.float32).reshape(FUSED)
    part = _fused_part(1)
    local = part.take(full)
    assert local.tolist() == [[2, 3, 6, 7, 10, 11], [14, 15, 18, 19, 22, 23]]
    assert part.sizes == (2, 6) and part.numel == 12 and not part.is_whole(FUSED)
    seen: list[object] = []
    assert torch.equal(part.read(_reader(full, seen), FUSED), local)
    assert None not in seen and len(seen) == 3
    back = torch.zeros(FUSED)
    part.put(back, local)
    assert torch.equal(back[:, 2:4], full[:, 2:4]) and float(back[:, 0:2].abs().sum()) == 0
    with pytest.raises(ValueError, match="cannot hold"):
        part.real(torch.zeros(2, 5))


def test_mark_sharded_records_the_part_on_the_tensor() -> None:
    # Catches: a marked parameter's gradient seen as replicated, or a part that cannot fit the
    # whole tensor accepted.
    weight = torch.nn.Parameter(torch.zeros(2, 6))
    assert sharded_view(weight) is None
    mark_sharded(weight, _fused_part(0), FUSED)
    view = sharded_view(torch.ones(2, 6), like=weight)
    assert isinstance(view, LocalShard) and view.shape == FUSED and view.part == _fused_part(0)
    assert shard_spec(weight).shape == FUSED
    with pytest.raises(ValueError, match="cannot hold"):
        mark_sharded(torch.zeros(2, 5), _fused_part(0), FUSED)
    with pytest.raises(ValueError, match="does not fit"):
        mark_sharded(torch.zeros(2, 6), _fused_part(0), (2, 8))


@distributed_test(2)
def test_blocks_gather_to_a_named_rank(rank: int, world_size: int) -> None:
    # Catches: a fused shard's segments put back at the offsets of one contiguous block.
    full = torch.arange(24, dtype=torch.float32).reshape(FUSED)
    part = _fused_part(rank)
    shard = LocalShard(part.take(full), part, FUSED)
    got = shard.gather(0)
    assert (got is not None and torch.equal(got, full)) if rank == 0 else got is None


def test_shard_parameter_keeps_its_part_and_pads_after_it() -> None:
    # Catches: the wrong rows kept, padding placed before the real rows, or a meta source
    # materialized (or forgotten) instead of remembered for a later materializer.
    whole = torch.nn.Parameter(torch.arange(12, dtype=torch.float32).reshape(6, 2))
    param = shard_parameter(whole, Block.along(whole.shape, 0, 4, 6), local_shape=(4, 2))
    assert param.tolist() == [[8, 9], [10, 11], [0, 0], [0, 0]] and param.requires_grad
    assert shard_spec(param).shape == (6, 2) and shard_source(param) is None
    meta = torch.empty(6, 2, device="meta")
    lazy = shard_parameter(meta, Block.along(meta.shape, 0, 0, 3))
    assert lazy.is_meta and lazy.shape == (3, 2) and shard_source(lazy) is meta
    with pytest.raises(ValueError, match="cannot hold"):
        shard_parameter(whole, Block.along(whole.shape, 0, 0, 3), local_shape=(2, 2))
