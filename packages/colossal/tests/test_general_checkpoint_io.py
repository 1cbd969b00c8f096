"""GeneralCheckpointIO (ColossalAI's plain IO) and the low_cpu_mem_mode / num_threads loads."""

from __future__ import annotations

import os

import pytest
import torch
from booster_testlib import full_state, make_booster, make_model, make_optimizer, train_steps
from torch import nn

from colossal.booster import Booster
from colossal.checkpoint_io import CheckpointIO, GeneralCheckpointIO, TensorReader
from colossal.core.testing import spawn


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = make_model(seed=3)
    optimizer = make_optimizer(model)
    for step in range(2):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)


def _same_optimizer(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert set(sa["state"]) == set(sb["state"]) and sa["state"]
    for index, states in sa["state"].items():
        for key, value in states.items():
            torch.testing.assert_close(sb["state"][index][key], value, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("shard", "use_safetensors"), [(False, False), (False, True), (True, False)]
)
def test_general_io_round_trip(tmp_path, shard: bool, use_safetensors: bool) -> None:
    """Model and optimizer come back exactly, as one file (torch or safetensors) or sharded.

    Catches: an unsharded save that is not a file at the given path (ColossalAI's tests pass
    a NamedTemporaryFile name), a torch file the loader cannot read, shards that lose a
    tensor, an optimizer file whose states or hyper-parameters do not come back.
    """
    model, optimizer = _trained()
    io = GeneralCheckpointIO()
    target = str(tmp_path / ("ckpt" if shard else "model.bin"))
    if not shard:
        open(target, "wb").close()  # an existing file, as NamedTemporaryFile leaves it
    io.save_model(
        model, target, shard=shard, size_per_shard=0.0005, use_safetensors=use_safetensors
    )
    optim_target = str(tmp_path / ("optim" if shard else "optim.bin"))
    io.save_optimizer(optimizer, optim_target, shard=shard, size_per_shard=0.0005)
    if shard:
        assert len([f for f in os.listdir(target) if f.endswith(".safetensors")]) > 1
    else:
        assert os.path.isfile(target) and os.path.isfile(optim_target)
        with open(target, "rb") as file:
            is_zip = file.read(2) == b"PK"  # torch.save's zip container
        assert is_zip != use_safetensors

    fresh = make_model(seed=9)
    fresh_optimizer = make_optimizer(fresh)
    assert not torch.equal(fresh.head.weight, model.head.weight)
    io.load_model(fresh, target)
    io.load_optimizer(fresh_optimizer, optim_target)
    _same_state(fresh.state_dict(), model.state_dict())
    _same_optimizer(fresh_optimizer, optimizer)


def test_general_io_refuses_async_torch_files(tmp_path) -> None:
    """Catches: use_async silently ignored for a torch.save file (the caller would wait on
    nothing); a directory passed as an unsharded file path."""
    model, optimizer = _trained()
    io = GeneralCheckpointIO()
    with pytest.raises(ValueError, match="use_safetensors=True"):
        io.save_model(model, str(tmp_path / "m.bin"), use_async=True)
    with pytest.raises(ValueError, match="shard=True"):
        io.save_model(model, str(tmp_path), use_safetensors=True)
    with pytest.raises(ValueError, match="use_async=False"):
        io.save_optimizer(optimizer, str(tmp_path / "o.bin"), use_async=True)


def test_low_cpu_mem_mode_loads_identical_tensors(tmp_path, monkeypatch) -> None:
    """Both modes load the same values; only low_cpu_mem_mode=False preloads, with num_threads.

    Catches: the flag ignored (no preload, or a preload in the streaming mode), num_threads
    not reaching the reader, a preloaded read that returns another tensor or slice.
    """
    model, optimizer = _trained()
    io = GeneralCheckpointIO()  # CheckpointIO's loads; names a plain optimizer's states
    io.save_model(model, str(tmp_path / "m"), shard=True, size_per_shard=0.0005)
    io.save_optimizer(optimizer, str(tmp_path / "m"), shard=True, size_per_shard=0.0005)
    calls: list[int] = []
    original = TensorReader.preload

    def spy(self: TensorReader, names: object = None, num_threads: int = 1) -> int:
        calls.append(num_threads)
        return original(self, names, num_threads)  # type: ignore[arg-type]

    monkeypatch.setattr(TensorReader, "preload", spy)
    loaded = []
    for low in (True, False):
        fresh = make_model(seed=11)
        fresh_optimizer = make_optimizer(fresh)
        io.load_model(fresh, str(tmp_path / "m"), low_cpu_mem_mode=low, num_threads=3)
        io.load_optimizer(fresh_optimizer, str(tmp_path / "m"), low_cpu_mem_mode=low, num_threads=3)
        _same_optimizer(fresh_optimizer, optimizer)
        loaded.append(fresh.state_dict())
        assert calls == ([] if low else [3, 3])
    _same_state(loaded[0], model.state_dict())
    _same_state(loaded[1], model.state_dict())
    with pytest.raises(ValueError, match="num_threads=0"):
        io.load_model(make_model(), str(tmp_path / "m"), num_threads=0)
    with pytest.raises(TypeError, match="low_cpu_mem_mode"):
        io.load_model(make_model(), str(tmp_path / "m"), low_cpu_mem_mode="yes")  # type: ignore[arg-type]


def test_preload_reads_every_file_in_threads(tmp_path) -> None:
    """Catches: preload skipping a shard file, reporting bytes it did not read, or serving a
    slice of another tensor."""
    model = make_model(seed=4)
    CheckpointIO().save_model(model, str(tmp_path / "m"), shard=True, size_per_shard=0.0005)
    from colossal.checkpoint_io import read_index

    index = read_index(str(tmp_path / "m"), "model.safetensors.index.json")
    streamed = TensorReader(str(tmp_path / "m"), index["weight_map"])
    preloaded = TensorReader(str(tmp_path / "m"), index["weight_map"])
    assert len(set(index["weight_map"].values())) > 1
    read = preloaded.preload(num_threads=4)
    assert read == sum(t.numel() * t.element_size() for t in model.state_dict().values())
    rows = (slice(1, 3),)
    for name in index["weight_map"]:
        torch.testing.assert_close(preloaded.read(name), streamed.read(name), rtol=0, atol=0)
        torch.testing.assert_close(preloaded.read(name, rows), streamed.read(name, rows))
        assert preloaded.shape(name) == streamed.shape(name)


def _zero_load(rank: int, world: int, root: str) -> list[dict[str, torch.Tensor]]:
    torch.set_num_threads(1)
    booster = make_booster("zero2")
    model = make_model(seed=5)
    optimizer = make_optimizer(model)
    model, optimizer, *_ = booster.boost(model, optimizer)
    train_steps(model, optimizer, booster, range(2), rank, world)
    booster.save_model(model, root, shard=True, size_per_shard=0.0005)
    booster.save_optimizer(optimizer, root, shard=True, size_per_shard=0.0005)
    booster.checkpoint_io._sync_d2h()
    booster.checkpoint_io._sync_io()
    out = [full_state(model, booster)]
    for low in (True, False):
        fresh_booster = make_booster("zero2")
        fresh = make_model(seed=6)
        fresh_optimizer = make_optimizer(fresh)
        fresh, fresh_optimizer, *_ = fresh_booster.boost(fresh, fresh_optimizer)
        fresh_booster.load_model(fresh, root, low_cpu_mem_mode=low, num_threads=2)
        fresh_booster.load_optimizer(fresh_optimizer, root, low_cpu_mem_mode=low, num_threads=2)
        fresh_optimizer.sync_masters_from_params()  # type: ignore[attr-defined]
        train_steps(fresh, fresh_optimizer, fresh_booster, range(2, 3), rank, world)
        out.append(full_state(fresh, fresh_booster))
    train_steps(model, optimizer, booster, range(2, 3), rank, world)
    out[0] = full_state(model, booster)
    return out


def test_booster_low_cpu_mem_mode_at_world_2_continues_training(tmp_path) -> None:
    """ZeRO-2 at world 2: a load in either mode continues training exactly as the original.

    Catches: the Booster not passing the two arguments on, a preloaded ZeRO slice read from
    the wrong elements (the next step's weights would differ), optimizer states lost.
    """
    for per_rank in spawn(_zero_load, 2, args=(str(tmp_path / "ckpt"),)):
        original, streamed, preloaded = per_rank
        _same_state(streamed, original)
        _same_state(preloaded, original)


def test_booster_signatures_match_colossalai() -> None:
    """Catches: ColossalAI's keyword names missing on the Booster (its scripts pass them)."""
    import inspect

    load_model = inspect.signature(Booster.load_model).parameters
    load_optimizer = inspect.signature(Booster.load_optimizer).parameters
    assert {"low_cpu_mem_mode", "num_threads", "strict"} <= set(load_model)
    assert {"prefix", "size_per_shard", "low_cpu_mem_mode", "num_threads"} <= set(load_optimizer)
    assert load_model["low_cpu_mem_mode"].default is True
