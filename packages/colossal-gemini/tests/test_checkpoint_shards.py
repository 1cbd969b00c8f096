"""Gemini's sharded-state views: whole tensors from one gather per chunk, slice loads.

Expected values come from each rank's own pieces (``Chunk.tensor_shard``,
``GeminiOptimizer.state_dict``), exchanged with an object all-gather in the test, never from
the gatherer under test.
"""

from __future__ import annotations

import gc
import time
import weakref
from typing import Any

import numpy
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from colossal.core import FlatRange, ShardedTensor
from colossal.core.testing import distributed_test
from colossal.gemini import (
    ChunkGatherer,
    GeminiDDP,
    GeminiOptimizer,
    load_piece,
    model_shards,
    optimizer_shards,
    param_part,
    refresh_chunks,
)
from colossal.kernels import HybridAdam

CHUNK = {"chunk_size": 40}  # parameters straddle the two ranks' shards


class Odd(nn.Module):
    """Awkward sizes (a flat range starts and ends inside rows) and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 13)
        self.b = nn.Linear(13, 11)
        self.c = nn.Linear(11, 3)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))) * self.scale


class TrackedGatherer(ChunkGatherer):
    """Counts the gather buffers alive (numpy-backed, so a weakref sees their storage)."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[weakref.ref] = []
        self.max_alive = 0

    def alive(self, expect: int = 0, timeout: float = 5.0) -> int:
        """Buffers still alive, waiting up to ``timeout`` s for at most ``expect``.

        gloo's worker thread drops its reference to a finished collective's tensors a moment
        after ``wait()`` returns; a buffer the gatherer really kept never goes.
        """
        deadline = time.monotonic() + timeout
        while True:
            gc.collect()  # count what is reachable, not what waits for the collector
            self.refs = [r for r in self.refs if r() is not None]
            if len(self.refs) <= expect or time.monotonic() > deadline:
                return len(self.refs)
            time.sleep(0.005)

    def _allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self.alive()
        array = numpy.empty(numel * dtype.itemsize, dtype=numpy.uint8)
        self.refs.append(weakref.ref(array))
        self.max_alive = max(self.max_alive, len(self.refs))
        return torch.from_numpy(array).view(dtype)


def _build(seed: int) -> tuple[GeminiDDP, GeminiOptimizer]:
    torch.manual_seed(seed)
    net = Odd()
    # Half the chunks kept gathered, half the masters on the host: every kind of chunk.
    model = GeminiDDP(net, precision="fp16", chunk_config_dict=dict(CHUNK),
                      shard_param_frac=0.5, offload_optim_frac=0.5)
    return model, GeminiOptimizer(HybridAdam(net.parameters(), lr=0.05), model,
                                  initial_scale=2**8)


def _step(model: GeminiDDP, opt: GeminiOptimizer, rank: int) -> None:
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
    opt.backward(nn.functional.mse_loss(model(x).float(), y))
    opt.step()


def _expected(model: GeminiDDP, opt: GeminiOptimizer) -> tuple[dict, dict]:
    """Full masters and moments assembled from every rank's own pieces."""
    mine: dict[str, Any] = {"masters": {}, "moments": opt.state_dict()["state"]}
    for name, p, chunk in model.named_chunk_params():
        start, stop, view = chunk.tensor_shard(p, source="master")
        mine["masters"][name] = (start, stop, tuple(chunk.infos[p].shape), view.clone().cpu())
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    masters: dict[str, torch.Tensor] = {}
    moments: dict[str, dict[str, torch.Tensor]] = {}
    for theirs in every:
        for name, (start, stop, shape, values) in theirs["masters"].items():
            full = masters.setdefault(name, torch.zeros(shape).reshape(-1))
            full[start:stop] = values
            for key in ("exp_avg", "exp_avg_sq"):
                if name in theirs["moments"]:
                    s = theirs["moments"][name]
                    buf = moments.setdefault(name, {}).setdefault(key, torch.zeros_like(full))
                    buf[s["range"][0] : s["range"][1]] = s[key].cpu()
    shapes = {n: m[2] for n, m in mine["masters"].items()}
    return ({n: v.reshape(shapes[n]) for n, v in masters.items()},
            {n: {k: v.reshape(shapes[n]) for k, v in s.items()} for n, s in moments.items()})


@distributed_test(2)
def test_gathers_stream_chunk_by_chunk_and_loads_read_slices(rank: int, world_size: int,
                                                             tmp_path: Any) -> None:
    """Whole tensors equal the ranks' pieces; one gather per chunk and state; one buffer held;
    a load reads only each rank's rows and resumes the masters, shards and payloads.

    Catches: a wrong flat range or offset (values differ), a gather per tensor instead of
    per chunk (the count), a gatherer that keeps every chunk (buffers alive), a loader that
    reads whole tensors or forgets the shard, the payload or the master (the checks after
    the load).
    """
    model, opt = _build(seed=1)
    for _ in range(2):
        _step(model, opt, rank)
    masters, moments = _expected(model, opt)
    chunks = model.chunk_manager.chunks
    assert len(chunks) >= 4 and any(c.keep_gathered for c in chunks)

    # Model: every tensor whole and exact, one all-gather per chunk, one buffer at a time.
    gatherer = TrackedGatherer()
    shards = model_shards(model, gatherer)
    assert list(shards) == [n for n, _, _ in model.named_chunk_params()]
    for name, tensor in shards.items():
        assert isinstance(tensor, ShardedTensor) and tensor.dtype == torch.float32
        assert tensor.shape == masters[name].shape
        part = tensor.part
        assert isinstance(part, FlatRange)
        assert torch.equal(part.real(tensor.local()).cpu(), masters[name].reshape(-1)[
            part.start : part.stop])
        whole = tensor.gather(dst=None)  # to every rank: all-gathers
        assert torch.equal(whole, masters[name]), name
        del whole
    assert gatherer.gathers == len(chunks)
    assert gatherer.max_alive == 1
    for name, tensor in shards.items():  # to the writer only: the others send and hold none
        to_one = tensor.gather(dst=1)
        assert (to_one is None) == (rank == 0)
        if to_one is not None:
            assert torch.equal(to_one, masters[name]), name
        del to_one
    assert gatherer.gathers == 2 * len(chunks)
    alive = gatherer.alive(expect=rank)  # the writer's last chunk only
    assert gatherer.max_alive == 1 and alive == rank, (gatherer.max_alive, alive)
    payload = max(c.chunk_size for c in chunks) * 4
    assert gatherer.peak_bytes <= payload

    # Optimizer: Adam moments, chunk by chunk and state by state: one gather each.
    gatherer = TrackedGatherer()
    states = optimizer_shards(opt, gatherer)
    flat = [(name, key, value) for name, entries in states.items()
            for key, value in entries.items() if isinstance(value, ShardedTensor)]
    flat.sort(key=lambda item: item[2].order)
    for name, key, value in flat:
        got = value.gather()
        assert torch.equal(got, moments[name][key]), (name, key)
        del got
    trainable = [c for c in chunks if c.requires_grad]
    assert (gatherer.gathers, gatherer.max_alive) == (2 * len(trainable), 1), (
        gatherer.gathers, gatherer.max_alive, len(trainable), sorted(states[flat[0][0]]))
    assert all(int(states[n]["step"]) == 2 for n in states)

    # Loading: a file of new values; each rank reads only the rows covering its range.
    path = str(tmp_path / "new.safetensors")
    new = {n: (v * 2 + 1).contiguous() for n, v in masters.items()}
    if rank == 0:
        save_file(new, path)
    dist.barrier()
    fresh, _ = _build(seed=7)
    reads: list[tuple[str, Any]] = []
    with safe_open(path, framework="pt") as file:
        for name, p, chunk in fresh.named_chunk_params():
            part = param_part(chunk, p)
            if part.numel == 0:
                continue

            def read(index: Any, name: str = name) -> torch.Tensor:
                reads.append((name, index))
                return file.get_tensor(name) if index is None else file.get_slice(name)[index]

            load_piece(chunk, p, part.read(read, new[name].shape))
    refresh_chunks(fresh.chunk_manager)
    rows = {n: v.shape[0] for n, v in new.items()}
    partial = [(n, i) for n, i in reads if i is not None and i[0].stop - i[0].start < rows[n]]
    assert partial, reads  # straddling parameters: only some rows were read
    for name, p, chunk in fresh.named_chunk_params():
        start, stop, master = chunk.tensor_shard(p, source="master")
        want = new[name].reshape(-1)[start:stop]
        assert torch.equal(master.cpu(), want), name
        _, _, shard = chunk.tensor_shard(p, source="shard")
        assert torch.equal(shard.cpu(), want.half()), name
    full = fresh.state_dict()  # gathers every payload (kept-gathered ones as they are)
    for name, value in new.items():
        assert torch.equal(full[name], value.half().float()), name
