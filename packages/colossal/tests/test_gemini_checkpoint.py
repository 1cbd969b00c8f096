"""Gemini in the checkpoint matrix: its saves load under DDP/ZeRO/FSDP2 and theirs into it.

Expected values never come from the code under test: Gemini's side is read from each rank's
own master pieces and Adam moments (``Chunk.tensor_shard`` and ``GeminiOptimizer.state_dict``,
no gather), assembled by range in the test process.
"""

from __future__ import annotations

import gc
import json
import os
import weakref
from typing import Any

import numpy
import pytest
import torch
from booster_testlib import (
    full_state,
    global_loss,
    local_batch,
    make_booster,
    make_model,
    make_optimizer,
    tiny_gpt2_config,
    train_steps,
)
from safetensors.torch import load_file
from torch import nn

from colossal.booster.plugin.gemini import checkpoint_io as gemini_checkpoint_io
from colossal.booster.plugin.gemini.checkpoint_io import GeminiCheckpointIO
from colossal.core.testing import spawn
from colossal.gemini import ChunkGatherer, GeminiDDP, GeminiOptimizer

SHARD_MB = 0.0005  # ~500-byte files: many files, written by both ranks
CHUNK_A = {"chunk_size": 64}  # parameters straddle the ranks' shards
CHUNK_B = {"chunk_size": 160}  # another layout for the loading side
STEPS = 3
MOMENTS = ("exp_avg", "exp_avg_sq")


class _Tracked(ChunkGatherer):
    """Counts the chunk buffers alive across a save (numpy-backed: weakrefs see them)."""

    refs: list[weakref.ref] = []
    max_alive = 0

    def _allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        gc.collect()
        array = numpy.empty(numel * dtype.itemsize, dtype=numpy.uint8)
        cls = type(self)
        cls.refs = [r for r in cls.refs if r() is not None] + [weakref.ref(array)]
        cls.max_alive = max(cls.max_alive, len(cls.refs))
        return torch.from_numpy(array).view(dtype)


def _held_chunks_in_one_file_save(gemini: GeminiDDP, opt: Any, root: str) -> int:
    """The most chunk buffers alive at once in a sync save of one big file each."""
    original = gemini_checkpoint_io.ChunkGatherer
    gemini_checkpoint_io.ChunkGatherer = _Tracked  # type: ignore[misc]
    try:
        io = GeminiCheckpointIO()
        io.save_model(gemini, f"{root}/one-file/model")
        io.save_optimizer(opt, f"{root}/one-file/optim")
    finally:
        gemini_checkpoint_io.ChunkGatherer = original  # type: ignore[misc]
    return _Tracked.max_alive


def _gemini(precision: str, chunk: dict[str, Any], seed: int) -> tuple[GeminiDDP, Any]:
    model = make_model(seed)
    optimizer = make_optimizer(model)
    gemini = GeminiDDP(model, precision=precision, chunk_config_dict=dict(chunk))
    return gemini, GeminiOptimizer(optimizer, gemini, initial_scale=2**8)


def _train(gemini: GeminiDDP, opt: Any, steps: range, rank: int, world: int) -> list[float]:
    losses = []
    for step in steps:
        x, y = local_batch(step, rank, world)
        loss = nn.functional.mse_loss(gemini(x).float(), y)
        opt.backward(loss)
        opt.step()
        losses.append(global_loss(loss))
    return losses


def _pieces(gemini: GeminiDDP, opt: Any) -> dict[str, Any]:
    """This rank's master pieces and moments (by range), without any gather."""
    masters = {}
    for name, p, chunk in gemini.named_chunk_params():
        start, stop, view = chunk.tensor_shard(p, source="master")
        masters[name] = (start, stop, tuple(chunk.infos[p].shape), view.detach().float().clone())
    moments = {
        name: {k: (*s["range"], s[k].detach().float().clone()) for k in MOMENTS}
        for name, s in opt.state_dict()["state"].items()
    }
    return {"masters": masters, "moments": moments}


def _assemble(ranks: list[dict[str, Any]]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Full masters and moments from every rank's pieces (every element covered once)."""
    shapes = {n: m[2] for r in ranks for n, m in r["masters"].items()}
    masters = {n: torch.full(s, float("nan")).reshape(-1) for n, s in shapes.items()}
    moments: dict[str, dict[str, torch.Tensor]] = {}
    for r in ranks:
        for name, (start, stop, _, values) in r["masters"].items():
            masters[name][start:stop] = values
        for name, states in r["moments"].items():
            for key, (start, stop, values) in states.items():
                full = moments.setdefault(name, {}).setdefault(
                    key, torch.full((masters[name].numel(),), float("nan")))
                full[start:stop] = values
    for name, value in masters.items():
        assert not value.isnan().any(), name
    return ({n: v.reshape(shapes[n]) for n, v in masters.items()},
            {n: {k: v.reshape(shapes[n]) for k, v in s.items()} for n, s in moments.items()})


def _other_moments(booster: Any, optimizer: Any, model: Any) -> dict[str, dict[str, Any]]:
    """Full Adam moments of a boosted DDP/ZeRO/FSDP optimizer, by parameter name."""
    io = booster.checkpoint_io
    names = [n for g in optimizer.param_names for n in g]
    state = io.optimizer_state(optimizer)["state"]
    return {names[int(i)]: {k: io.to_full(s[k]).detach().float().cpu() for k in MOMENTS}
            for i, s in state.items()}


def _save_and_cross_load(rank: int, world: int, root: str, precision: str) -> dict[str, Any]:
    io = GeminiCheckpointIO()
    gemini, opt = _gemini(precision, CHUNK_A, seed=1234)
    _train(gemini, opt, range(STEPS), rank, world)
    background = precision == "bf16"  # one row saves in the background (async)
    io.save_model(gemini, f"{root}/gemini/model", shard=True, size_per_shard=SHARD_MB,
                  use_async=background)
    io.save_optimizer(opt, f"{root}/gemini/optim", shard=True, size_per_shard=SHARD_MB,
                      use_async=background)
    io.synchronize()
    saved = _pieces(gemini, opt)
    held = _held_chunks_in_one_file_save(gemini, opt, root)
    uninterrupted = _train(gemini, opt, range(STEPS, 2 * STEPS), rank, world)
    final = _pieces(gemini, opt)

    out: dict[str, Any] = {"saved": saved, "final": final, "held": held,
                           "chunks": len(gemini.chunk_manager.chunks)}
    # Resume in Gemini with another chunk size: exactly the uninterrupted run.
    for label, chunk in (("same", CHUNK_A), ("other", CHUNK_B)):
        gemini2, opt2 = _gemini(precision, chunk, seed=99)
        io.load_model(gemini2, f"{root}/gemini/model")
        io.load_optimizer(opt2, f"{root}/gemini/optim")
        out[f"resumed_{label}"] = _train(gemini2, opt2, range(STEPS, 2 * STEPS), rank, world)
        out[f"resumed_{label}_final"] = _pieces(gemini2, opt2)
    out["uninterrupted"] = uninterrupted

    # The Gemini checkpoint under ZeRO-2 and FSDP2 (fp32) at this world size.
    for plugin in ("zero2", "fsdp"):
        booster = make_booster(plugin)
        model = make_model(seed=99)
        optimizer = make_optimizer(model)
        model, optimizer, *_ = booster.boost(model, optimizer)
        booster.load_model(model, f"{root}/gemini/model")
        booster.load_optimizer(optimizer, f"{root}/gemini/optim")
        out[plugin] = (full_state(model, booster), _other_moments(booster, optimizer, model))

    # The reverse: a ZeRO-2 save (bf16) loads into Gemini with another chunk size.
    booster = make_booster("zero2", "bf16")
    model = make_model(seed=5)
    optimizer = make_optimizer(model)
    model, optimizer, *_ = booster.boost(model, optimizer)
    train_steps(model, optimizer, booster, range(STEPS), rank, world)
    booster.save_model(model, f"{root}/zero/model", shard=True, size_per_shard=SHARD_MB)
    booster.save_optimizer(optimizer, f"{root}/zero/optim", shard=True, size_per_shard=SHARD_MB)
    out["zero_saved"] = (full_state(model, booster), _other_moments(booster, optimizer, model))
    gemini3, opt3 = _gemini(precision, CHUNK_B, seed=99)
    io.load_model(gemini3, f"{root}/zero/model")
    io.load_optimizer(opt3, f"{root}/zero/optim")
    torch.distributed.barrier()
    if rank == 0:  # the loaded states are Gemini's own, not views of the files' mappings
        _overwrite_tensor_files(f"{root}/zero/optim")
    torch.distributed.barrier()
    out["zero_into_gemini"] = _pieces(gemini3, opt3)
    return out


def _overwrite_tensor_files(directory: str) -> None:
    """Rewrite every tensor byte of the directory's safetensors files in place (``cp``-like)."""
    for name in os.listdir(directory):
        if not name.endswith(".safetensors"):
            continue
        path = os.path.join(directory, name)
        size = os.path.getsize(path)
        with open(path, "r+b") as file:
            header = 8 + int.from_bytes(file.read(8), "little")
            file.seek(header)
            file.write(b"\x7f" * (size - header))


def _equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    for name, value in expected.items():
        torch.testing.assert_close(actual[name].float().cpu(), value, rtol=0, atol=0,
                                   msg=lambda m, n=name: f"{what} {n}: {m}")


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_gemini_checkpoint_matrix(tmp_path: Any, precision: str) -> None:
    root = str(tmp_path)
    results = spawn(_save_and_cross_load, 2, args=(root, precision))
    masters, moments = _assemble([r["saved"] for r in results])
    final_masters, final_moments = _assemble([r["final"] for r in results])
    r0 = results[0]
    # A sync save holds the chunk being gathered and at most the one being written, however
    # many chunks share a file (not every chunk of the file until it is durable).
    assert r0["chunks"] >= 4
    assert all(r["held"] <= 2 for r in results), [r["held"] for r in results]
    # Resume is bit-identical to the uninterrupted run (same or another chunk size).
    for label in ("same", "other"):
        assert r0[f"resumed_{label}"] == r0["uninterrupted"], label
        got_masters, got_moments = _assemble([r[f"resumed_{label}_final"] for r in results])
        _equal(got_masters, final_masters, f"resumed ({label}) master")
        for name in final_moments:
            _equal(got_moments[name], final_moments[name], f"resumed ({label}) {name}")
    # ZeRO-2 and FSDP2 (world 2) read the Gemini checkpoint: fp32 masters and moments.
    for plugin in ("zero2", "fsdp"):
        state, their_moments = r0[plugin]
        _equal(state, masters, f"{plugin} param")
        assert state["offset"].tolist() == make_model().offset.tolist()
        for name in moments:
            _equal(their_moments[name], moments[name], f"{plugin} {name}")
    # DDP at world 1 reads it too.
    booster = make_booster("none")
    plain = make_model(seed=99)
    plain_opt = make_optimizer(plain)
    plain, plain_opt, *_ = booster.boost(plain, plain_opt)
    booster.load_model(plain, os.path.join(root, "gemini", "model"))
    booster.load_optimizer(plain_opt, os.path.join(root, "gemini", "optim"))
    _overwrite_tensor_files(os.path.join(root, "gemini", "optim"))  # states are DDP's own
    _equal(full_state(plain, booster), masters, "ddp@1 param")
    ddp_moments = _other_moments(booster, plain_opt, plain)
    for name in moments:
        _equal(ddp_moments[name], moments[name], f"ddp@1 {name}")
    # The ZeRO save loaded into Gemini (another chunk size): masters and moments equal.
    zero_state, zero_moments = r0["zero_saved"]
    got_masters, got_moments = _assemble([r["zero_into_gemini"] for r in results])
    _equal(got_masters, {n: v for n, v in zero_state.items() if n != "offset"}, "zero->gemini")
    for name in zero_moments:
        _equal(got_moments[name], zero_moments[name], f"zero->gemini {name}")
    index = json.load(open(os.path.join(root, "gemini", "model", "model.safetensors.index.json")))
    assert len(index["metadata"]["files"]) > 2  # sharded, spread over the ranks


def _gpt2() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(tiny_gpt2_config())


def test_gpt2_saved_from_gemini_loads_with_from_pretrained(tmp_path: Any) -> None:
    """One process (the rows above spread the writing): config, tied weights, same logits."""
    transformers = pytest.importorskip("transformers")
    path = str(tmp_path / "gpt2")
    gemini = GeminiDDP(_gpt2(), precision="bf16", chunk_config_dict={"chunk_size": 4096})
    GeminiCheckpointIO().save_model(gemini, path, shard=True, size_per_shard=0.05)
    reference = _gpt2().eval()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    torch.testing.assert_close(loaded(ids).logits, reference(ids).logits, rtol=0, atol=0)
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
    assert "lm_head.weight" not in index["weight_map"]  # tied weights saved once
    assert len(index["metadata"]["files"]) > 1
    single = str(tmp_path / "gpt2.safetensors")  # one file, no index (streamed too)
    GeminiCheckpointIO().save_model(gemini, single)
    weights = load_file(single)
    assert sorted(weights) == sorted(index["weight_map"])
    for name, value in weights.items():
        torch.testing.assert_close(value, reference.state_dict()[name], rtol=0, atol=0)
