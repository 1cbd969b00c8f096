"""Checkpoint integrity: checksums shared over ranks, crash-safe commit, kill mid-write."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from booster_testlib import make_booster, make_model
from torch import nn

import colossal.checkpoint_io.durable as durable_mod
import colossal.checkpoint_io.index as index_mod
import colossal.checkpoint_io.inplace as inplace_mod
import colossal.checkpoint_io.saver as saver_mod
from colossal.booster import Booster
from colossal.checkpoint_io import MODEL_INDEX, CheckpointError
from colossal.core.testing import spawn

WRITERS = ["staging", "in_place"]
"""How sync saves of replicated state are written: each file by one rank through the staging
folder (``write_in_place=False``), or every rank its share in place (the default)."""


def _booster(writer: str, plugin: str = "none") -> Booster:
    booster = make_booster(plugin)
    booster.checkpoint_io.write_in_place = writer == "in_place"
    return booster


# ---- checksums: each file verified by one rank, verdict agreed -------------------------------


def _load_at_world_2(rank: int, world_size: int, path: str, corrupt: bool) -> tuple:
    import torch.distributed as dist

    booster = make_booster("ddp")
    model, *_ = booster.boost(make_model())
    booster.save_model(model, path, shard=True, size_per_shard=0.0005)
    files = sorted(json.load(open(os.path.join(path, MODEL_INDEX)))["metadata"]["files"])
    victim = files[1]  # file 1 is verified by rank 1 only
    if corrupt and rank == 0:
        with open(os.path.join(path, victim), "r+b") as file:
            file.seek(-1, os.SEEK_END)
            last = file.read(1)
            file.seek(-1, os.SEEK_END)
            file.write(bytes([last[0] ^ 0xFF]))
    dist.barrier()
    read: list[str] = []
    original = index_mod.file_crc32

    def spy(file: str, *args: object) -> str:
        read.append(os.path.basename(file))
        return original(file, *args)

    index_mod.file_crc32 = spy
    fresh, *_ = make_booster("ddp").boost(make_model(seed=7))
    try:
        booster.load_model(fresh, path)
        error = None
    except CheckpointError as err:
        error = str(err)
    finally:
        index_mod.file_crc32 = original
    values = {k: v.clone() for k, v in fresh.unwrap().state_dict().items()}
    return files, victim, read, error, values


def test_checksums_are_split_over_ranks_and_agreed(tmp_path) -> None:
    reference = make_model().state_dict()
    results = spawn(_load_at_world_2, 2, args=(str(tmp_path / "good"), False))
    files = results[0][0]
    assert len(files) >= 3
    reads = [r[2] for r in results]
    assert reads[0] == files[0::2] and reads[1] == files[1::2]  # each file read once, by i % 2
    for _, _, _, error, values in results:
        assert error is None
        for k, v in reference.items():
            torch.testing.assert_close(values[k], v)

    results = spawn(_load_at_world_2, 2, args=(str(tmp_path / "bad"), True))
    victim = results[0][1]
    assert victim not in results[0][2] and victim in results[1][2]  # only rank 1 read it
    for rank, (_, _, _, error, _) in enumerate(results):
        assert error is not None, f"rank {rank} loaded a corrupt checkpoint"
        assert victim in error and "CRC-32" in error, error
    assert "found by rank 1" in results[0][3]


def _save_to_node_local_paths(rank: int, world_size: int, root: str, writer: str) -> str | None:
    """Each rank passes its own directory, as ranks on different nodes with local disks."""
    booster = _booster(writer, "ddp")
    model, *_ = booster.boost(make_model())
    try:
        booster.save_model(model, os.path.join(root, f"node{rank}", "ckpt"), shard=True)
    except CheckpointError as err:
        return str(err)
    return None


@pytest.mark.parametrize("writer", WRITERS)
def test_save_needs_a_filesystem_shared_by_the_ranks(tmp_path, writer) -> None:
    errors = spawn(_save_to_node_local_paths, 2, args=(str(tmp_path), writer))
    for error in errors:  # every rank fails at once with the reason, none waits for the rest
        seen = "ranks [1] do not see" if writer == "staging" else "rank 1 does not see"
        assert error is not None and seen in error and "shared" in error, error
    if writer == "staging":
        assert os.listdir(tmp_path / "node0") == []  # the staging directory was removed
    else:  # the files rank 0 created, and the directories it created for them, are gone
        assert os.listdir(tmp_path) == []


def test_single_process_verifies_every_file(tmp_path, monkeypatch) -> None:
    booster = Booster()
    model, *_ = booster.boost(make_model())
    path = str(tmp_path / "ckpt")
    booster.save_model(model, path, shard=True, size_per_shard=0.0005)
    read: list[str] = []
    original = index_mod.file_crc32
    monkeypatch.setattr(
        index_mod, "file_crc32", lambda f, *a: read.append(os.path.basename(f)) or original(f, *a)
    )
    booster.load_model(make_model(seed=3), path)
    files = sorted(json.load(open(os.path.join(path, MODEL_INDEX)))["metadata"]["files"])
    assert read == files


# ---- the index is the commit point: a complete checkpoint is loadable at every instant -------


class _Config:
    """A Hugging Face-like config, so that the save also writes ``config.json``."""

    def __init__(self, value: float) -> None:
        self.value = value

    def to_json_string(self) -> str:
        return json.dumps({"value": self.value})


def _linear(value: float) -> nn.Module:
    model = nn.Linear(8, 4)
    with torch.no_grad():
        model.weight.fill_(value)
        model.bias.fill_(value)
    model.config = _Config(value)
    return model


def _save(path: str, value: float, shard_mb: float = 1024, writer: str = "staging") -> None:
    booster = _booster(writer)
    model, *_ = booster.boost(_linear(value))
    booster.save_model(model, path, shard=True, size_per_shard=shard_mb)


def _loaded_value(path: str) -> float:
    fresh = _linear(-1.0)
    Booster().load_model(fresh, path)
    values = torch.cat([fresh.weight.flatten(), fresh.bias]).detach()
    assert torch.all(values == values[0]), "a mix of two checkpoints was loaded"
    return float(values[0].detach())


def _model_files(path: str) -> set[str]:
    return {n for n in os.listdir(path) if n.startswith(("model", ".model", ".colossal-model"))}


def _referenced(path: str) -> set[str]:
    with open(os.path.join(path, MODEL_INDEX)) as file:
        return set(json.load(file)["weight_map"].values()) | {MODEL_INDEX}


class _CrashError(Exception):
    pass


def _setup(root: str, state: str) -> str:
    """A checkpoint (value 1) at ``path`` in ``state``, and a user file next to it."""
    if os.path.exists(root):
        shutil.rmtree(root)
    path = os.path.join(root, "ckpt")
    os.makedirs(path)
    with open(os.path.join(path, "notes.txt"), "w") as file:
        file.write("mine")
    if state == "empty":  # the first save into a directory of the user
        return path
    _save(path, 1.0)
    if state == "after-alternate":  # the current checkpoint uses the alternate names
        _save(path, 0.5)
        _save(path, 1.0)
    elif state == "leftovers":  # an earlier save crashed after writing a shard and its meta
        with open(os.path.join(path, "model-00001-of-00001.safetensors"), "wb") as file:
            file.write(b"garbage")
        with open(os.path.join(path, ".model.safetensors.0123456789ab.tmp"), "wb") as file:
            file.write(b"half a file")
        os.makedirs(os.path.join(path, ".colossal-model-save"))
        with open(os.path.join(path, ".colossal-model-save", "rank0.meta.json"), "w") as file:
            file.write("{}")
    return path


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("shard_mb", [1024, 0.00005])
@pytest.mark.parametrize("state", ["empty", "main", "after-alternate", "leftovers"])
def test_commit_is_crash_safe_at_every_step(tmp_path, monkeypatch, state, shard_mb,
                                            writer) -> None:
    """Crash at every rename and delete of a save: the old or the new checkpoint loads.

    In place, the renames of the written files are steps too, and a save that crashed before
    its commit leaves the directory as it found it.
    """
    replace, remove, rename = durable_mod.replace, durable_mod.remove, inplace_mod._rename
    outcomes = []
    for crash_at in range(30):
        path = _setup(str(tmp_path / "root"), state)
        before = os.listdir(path)
        count = [0]

        def step(fn, *args, crash_at=crash_at, count=count):
            if count[0] == crash_at:
                raise _CrashError
            count[0] += 1
            return fn(*args)

        monkeypatch.setattr(durable_mod, "replace", lambda *a: step(replace, *a))
        monkeypatch.setattr(durable_mod, "remove", lambda *a: step(remove, *a))
        monkeypatch.setattr(inplace_mod, "_rename", lambda *a: step(rename, *a))
        try:
            _save(path, 2.0, shard_mb, writer)
            crashed = False
        except _CrashError:
            crashed = True
        monkeypatch.setattr(durable_mod, "replace", replace)
        monkeypatch.setattr(durable_mod, "remove", remove)
        monkeypatch.setattr(inplace_mod, "_rename", rename)
        if state == "empty" and not os.path.exists(os.path.join(path, MODEL_INDEX)):
            with pytest.raises(CheckpointError, match="interrupted|holds no model checkpoint"):
                _loaded_value(path)
            value = 1.0  # nothing was committed, and nothing is loaded
        else:
            value = _loaded_value(path)  # the old or the new checkpoint, never a mix
        assert value in (1.0, 2.0), (state, crash_at, value)
        if writer == "in_place" and value == 1.0:  # not committed: its files are removed
            assert set(os.listdir(path)) <= set(before), (state, crash_at)  # (and leftovers)
        outcomes.append(value)
        _save(path, 3.0, shard_mb, writer)  # the next save recovers from whatever was left
        assert _loaded_value(path) == 3.0
        with open(os.path.join(path, "config.json")) as file:
            assert json.load(file)["value"] == 3.0
        assert _model_files(path) == _referenced(path)  # stale shards and leftovers are gone
        assert set(os.listdir(path)) == _referenced(path) | {"config.json", "notes.txt"}
        if not crashed:
            break
    else:
        pytest.fail("the save never finished")
    assert outcomes[0] == 1.0 and outcomes[-1] == 2.0 and len(outcomes) > 2


def test_leftover_old_of_the_directory_swap_loads(tmp_path) -> None:
    """A ``.colossal-old`` left by the directory swap of earlier versions still loads."""
    path = str(tmp_path / "ckpt")
    _save(path, 1.0)
    os.replace(path, path + ".colossal-old")
    assert _loaded_value(path) == 1.0
    _save(path, 2.0)
    assert _loaded_value(path) == 2.0


@pytest.mark.parametrize("writer", WRITERS)
def test_interrupted_save_is_ignored(tmp_path, monkeypatch, writer) -> None:
    """Shards written but never committed: the loader keeps to the committed index.

    In place, the interrupted save removes its files, and the directory it created.
    """
    path = str(tmp_path / "ckpt")
    module = saver_mod if writer == "staging" else inplace_mod

    def interrupted_save(value: float) -> None:  # every shard written, the index never
        monkeypatch.setattr(module, "commit_index", _crash)
        with pytest.raises(_CrashError):
            _save(path, value, writer=writer)
        monkeypatch.undo()

    interrupted_save(5.0)
    if writer == "staging":
        with pytest.raises(CheckpointError, match="interrupted"):
            _loaded_value(path)
    else:
        assert os.listdir(tmp_path) == []  # the directory it created is gone
    _save(path, 1.0, writer=writer)
    before = sorted(os.listdir(path))
    interrupted_save(5.0)
    assert _loaded_value(path) == 1.0
    if writer == "in_place":
        assert sorted(os.listdir(path)) == before  # nothing of the interrupted save is left
    _save(path, 2.0, writer=writer)  # replaces the leftovers of the interrupted save
    assert _loaded_value(path) == 2.0
    assert _model_files(path) == _referenced(path)


def _crash(*args: object) -> None:
    raise _CrashError


# ---- kill the writer mid-write ----------------------------------------------------------------

_KILL_MID_WRITE = textwrap.dedent(
    """
    import os, sys, torch
    import colossal.core.io._atomic_file as atomic_file
    from colossal.booster import Booster
    from colossal.checkpoint_io import inplace

    path, mode = sys.argv[1], sys.argv[2]

    async def write_half_then_die(file, data):
        if len(data) < 64 * 1024:  # headers and small tensors: written normally
            while data:
                data = data[await file.write(data):]
            return
        part = data[: len(data) // 2 // 4096 * 4096]
        while part:
            part = part[await file.write(part):]
        await file.flush()
        os._exit(17)  # the process dies in the middle of writing this file

    pwrite_all = inplace._pwrite_all

    def pwrite_half_then_die(fd, view, offset):
        if len(view) < 64 * 1024:  # small tensors: written normally
            return pwrite_all(fd, view, offset)
        pwrite_all(fd, view[: len(view) // 2 // 4096 * 4096], offset)
        os._exit(17)  # the process dies in the middle of writing its part of this file

    atomic_file._write_chunk = write_half_then_die
    inplace._pwrite_all = pwrite_half_then_die
    booster = Booster()
    booster.checkpoint_io.write_in_place = mode == "in_place"
    model, *_ = booster.boost(torch.nn.Linear(1024, 1024))
    with torch.no_grad():
        model.weight.fill_(7.0)
        model.bias.fill_(7.0)
    booster.save_model(model, path, shard=True, size_per_shard=1, use_async=mode == "async")
    booster.wait_async_saves()
    os._exit(0)  # reached only if no large chunk was written
    """
)


@pytest.mark.parametrize("mode", ["sync", "async", "in_place"])
def test_kill_mid_write_keeps_old_checkpoint(tmp_path, mode) -> None:
    """``sync`` and ``async`` write through the staging folder, ``in_place`` (sync) not."""
    torch.manual_seed(0)
    old = nn.Linear(1024, 1024)
    booster = _booster(mode)
    boosted, *_ = booster.boost(old)
    path = str(tmp_path / "ckpt")
    booster.save_model(boosted, path, shard=True, size_per_shard=1)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", _KILL_MID_WRITE, path, mode], env=env, check=False, timeout=300
    )
    assert done.returncode == 17, "the writer was not killed mid-write"
    partial = {
        name: os.path.getsize(os.path.join(path, name))
        for name in os.listdir(path)
        if name.endswith(".tmp") and name.startswith(".model-")
    }
    full = 1024 * 1024 * 4
    if mode == "in_place":  # created at full size: the written half, then zeros
        assert partial, os.listdir(path)
        tails = [open(os.path.join(path, n), "rb").read()[-4096:] for n in partial]
        assert any(tail == bytes(4096) for tail in tails), partial  # killed mid-file
    else:
        assert any(0 < size < full for size in partial.values()), partial  # killed mid-file
    fresh = nn.Linear(1024, 1024)
    booster.load_model(fresh, path)
    torch.testing.assert_close(fresh.weight, old.weight, rtol=0, atol=0)
    torch.testing.assert_close(fresh.bias, old.bias, rtol=0, atol=0)
    assert not torch.any(fresh.weight == 7.0)
    with torch.no_grad():
        old.weight.fill_(3.0)  # the next save succeeds despite the leftovers
    booster.save_model(boosted, path, shard=True, size_per_shard=1)
    booster.load_model(fresh, path)
    assert torch.all(fresh.weight == 3.0)
    assert not [n for n in os.listdir(path) if n.startswith(".")]  # the leftovers are gone
