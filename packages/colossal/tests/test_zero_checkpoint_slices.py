"""ZeRO optimizer checkpoints: each rank reads only its slices and gathers only what it writes."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist
from booster_testlib import train_steps
from safetensors.torch import load_file
from torch import nn

from colossal.booster import Booster
from colossal.booster.plugin.zero.checkpoint_io import ZeroCheckpointIO
from colossal.checkpoint_io import OPTIMIZER_INDEX, TensorReader
from colossal.checkpoint_io.names import param_names
from colossal.checkpoint_io.optimizer_state import indexed_to_named
from colossal.core.testing import distributed_test

SHARD_MB = 0.001  # ~1 KB files: writing is spread over the ranks
BUCKET_M = 100 / 1024**2  # ~100-element buckets: parameters straddle rank slices


class Odd(nn.Module):
    """Parameters of awkward sizes, so slices start and end inside rows."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 13)
        self.b = nn.Linear(13, 11)
        self.c = nn.Linear(11, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _boost(stage: int, precision: str, seed: int) -> tuple[Booster, Any, Any]:
    from colossal.booster.plugin import LowLevelZeroPlugin

    plugin = LowLevelZeroPlugin(
        stage=stage, precision=precision, initial_scale=2**8, reduce_bucket_size_in_m=BUCKET_M
    )
    booster = Booster(plugin=plugin)
    torch.manual_seed(seed)
    model = Odd()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, *_ = booster.boost(model, optimizer)
    return booster, model, optimizer


class _FullGather(ZeroCheckpointIO):
    """The old way of saving: every rank all-gathers the whole state first."""

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return optimizer.state_dict()


def _files(directory: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, name)))
    return out


@distributed_test(2, 4)
def test_load_reads_only_local_slices(rank: int, world_size: int, tmp_path: Any) -> None:
    stage, precision = (2, "bf16") if world_size == 2 else (1, "fp16")
    booster, model, optimizer = _boost(stage, precision, seed=1)
    train_steps(model, optimizer, booster, range(3), rank, world_size)
    model_dir, optim_dir = str(tmp_path / "model"), str(tmp_path / "optim")
    booster.save_model(model, model_dir, shard=True, size_per_shard=SHARD_MB)
    booster.save_optimizer(optimizer, optim_dir, shard=True, size_per_shard=SHARD_MB)
    expected = train_steps(model, optimizer, booster, range(3, 6), rank, world_size)

    booster, model, optimizer = _boost(stage, precision, seed=2)
    booster.load_model(model, model_dir)
    read_bytes = 0
    original = TensorReader.read

    def spy(self: TensorReader, name: str, index: Any = None) -> torch.Tensor:
        nonlocal read_bytes
        tensor = original(self, name, index)
        read_bytes += tensor.numel() * tensor.element_size()
        return tensor

    TensorReader.read = spy  # type: ignore[method-assign]
    try:
        booster.load_optimizer(optimizer, optim_dir)
    finally:
        TensorReader.read = original  # type: ignore[method-assign]

    with open(os.path.join(optim_dir, OPTIMIZER_INDEX), encoding="utf-8") as file:
        full_bytes = json.load(file)["metadata"]["total_size"]
    # Rows covering a slice may add at most a row at each end of each tensor.
    assert read_bytes < full_bytes * (1 / world_size + 0.25), (read_bytes, full_bytes)
    totals = torch.tensor([read_bytes], dtype=torch.float64)
    dist.all_reduce(totals)
    assert totals.item() < full_bytes * 1.5, (totals.item(), full_bytes)  # no rank reads all

    # What the slices rebuilt equals the full stored tensors, bit for bit.
    loaded, _ = indexed_to_named(optimizer.state_dict(), param_names(optimizer))
    stored = _files(optim_dir)
    assert sorted(loaded) == sorted(stored)
    for key, value in stored.items():
        assert torch.equal(loaded[key].cpu(), value), key
    resumed = train_steps(model, optimizer, booster, range(3, 6), rank, world_size)
    assert resumed == expected, (resumed, expected)


@distributed_test(2)
def test_save_gathers_only_what_a_rank_writes(rank: int, world_size: int, tmp_path: Any) -> None:
    booster, model, optimizer = _boost(2, "bf16", seed=1)
    train_steps(model, optimizer, booster, range(2), rank, world_size)
    io = booster.checkpoint_io
    gathered: list[int] = []
    kept = 0
    to_full, write = io.to_full, io.saver.writer.save

    def spy_gather(tensor: torch.Tensor, dst: int) -> torch.Tensor | None:
        full = to_full(tensor, dst)
        if full is not None and full is not tensor:
            gathered.append(full.numel() * full.element_size())
        return full

    def spy_write(tensors: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        nonlocal kept
        kept += sum(t.numel() * t.element_size() for t in tensors.values())
        return write(tensors, *args, **kwargs)

    io.to_full, io.saver.writer.save = spy_gather, spy_write
    ours, reference = str(tmp_path / "sharded"), str(tmp_path / "full")
    booster.save_optimizer(optimizer, ours, shard=True, size_per_shard=SHARD_MB)
    # The old way: every rank all-gathers the whole state (optimizer.state_dict()).
    full_state = optimizer.state_dict()
    tensors = indexed_to_named(full_state, param_names(optimizer))[0].values()
    full_bytes = sum(t.numel() * t.element_size() for t in tensors)
    sharded_bytes = sum(t.numel() * t.element_size() for t in tensors if t.dim() > 0)
    old_way = _FullGather()
    old_way.write_in_place = False  # each file by one rank, as ours (the same byte layout)
    old_way.save_optimizer(optimizer, reference, shard=True, size_per_shard=SHARD_MB)

    # Held at once: the files this rank writes (kept until they are durable) plus the one
    # state being gathered; about half of the whole state at world 2. A rank receives only
    # the states it writes, each sharded state reaches exactly one rank.
    peak = kept + max(gathered, default=0)
    assert sum(gathered) <= kept
    assert 0.3 * full_bytes < kept < 0.7 * full_bytes, (kept, full_bytes)
    assert peak < 0.75 * full_bytes, (peak, full_bytes)
    both = torch.tensor([kept, sum(gathered)], dtype=torch.float64)
    dist.all_reduce(both)
    assert both[0].item() == full_bytes  # each key written by exactly one rank
    assert both[1].item() == sharded_bytes  # and each sharded state gathered only there

    if rank == 0:  # the same files, byte for byte
        names = sorted(os.listdir(ours))
        assert names == sorted(os.listdir(reference))
        assert any(n.endswith(".safetensors") for n in names)
        for name in names:
            with (
                open(os.path.join(ours, name), "rb") as a,
                open(os.path.join(reference, name), "rb") as b,
            ):
                assert a.read() == b.read(), name
    dist.barrier()
