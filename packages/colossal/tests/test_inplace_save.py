"""In-place saves: every rank writes its own FlatRange bytes, no gather, same files.

Reference values come from zlib (CRC-32 of concatenations) and from the streamed save of the
same Gemini model and optimizer (byte-for-byte), never from the in-place code itself.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import sys
import textwrap
import zlib
from typing import Any

import pytest
import torch
from booster_testlib import local_batch, make_model, make_optimizer
from torch import nn

from colossal.booster.plugin.gemini.checkpoint_io import GeminiCheckpointIO
from colossal.checkpoint_io import CheckpointError, inplace
from colossal.checkpoint_io.checksum import crc32, crc32_combine
from colossal.checkpoint_io.inplace import Piece, check_tiling, combine_pieces
from colossal.core.testing import spawn
from colossal.gemini import ChunkGatherer, GeminiDDP, GeminiOptimizer

SHARD_MB = 0.0005  # ~500-byte files: many files, tensors of a chunk over several of them
CHUNK = {"chunk_size": 64}  # parameters straddle the ranks' shards


# ---- CRC-32 combine (catches: a shift in bits instead of bytes, a wrong x^(2^k) table,
# ---- the order of the operands, a mishandled empty or odd-length tail) -----------------------
def test_crc32_combine_matches_zlib_of_the_concatenation() -> None:
    rng = random.Random(7)
    lengths = [0, 1, 2, 3, 7, 8, 31, 255, 1000, 4097, 65537]
    for la in lengths:
        for lb in lengths:
            a, b = rng.randbytes(la), rng.randbytes(lb)
            got = crc32_combine(zlib.crc32(a), zlib.crc32(b), lb)
            assert got == zlib.crc32(a + b), (la, lb)
    big = bytes(3_000_001)  # a long run of zeros: many doublings
    assert crc32_combine(zlib.crc32(b"xyz"), zlib.crc32(big), len(big)) == zlib.crc32(b"xyz" + big)
    with pytest.raises(ValueError, match="len2"):
        crc32_combine(0, 0, -1)


def test_fast_crc32_equals_zlib_on_any_split() -> None:
    """Catches a backend with another polynomial or init (zlib-ng's CRC-32C, Adler-32), or a
    continuation value that is ignored: the index records CRCs any zlib can check."""
    rng = random.Random(3)
    data = rng.randbytes(1 << 20) + bytes(4097)
    assert crc32(data) == zlib.crc32(data)
    for cut in (0, 1, 4096, 777_777, len(data)):
        assert crc32(data[cut:], crc32(data[:cut])) == zlib.crc32(data), cut
    view = memoryview(torch.arange(1000, dtype=torch.float32).numpy()).cast("B")
    assert crc32(view) == zlib.crc32(view)


def test_combined_pieces_give_the_file_crc_in_any_order() -> None:
    data = random.Random(3).randbytes(1001)
    cuts = [0, 8, 9, 500, 777, 1001]
    pieces = [Piece("f", a, b - a, zlib.crc32(data[a:b])) for a, b in itertools.pairwise(cuts)]
    assert combine_pieces(pieces[::-1]) == f"{zlib.crc32(data):08x}"


# ---- tiling (catches: a rank's part silently missing, two ranks writing the same bytes) --------
def test_checksums_of_pieces_equal_the_written_bytes(tmp_path: Any, monkeypatch: Any) -> None:
    """Parts written in several pieces (each checksummed as it is written) combine to the
    CRC-32 of the bytes on disk; a wrong piece length or order in the combination would
    not."""
    monkeypatch.setattr(inplace, "PIECE_BYTES", 40)  # 10 fp32 elements per piece
    path = str(tmp_path / "parts.bin")
    with open(path, "wb") as file:
        file.truncate(4 * 97 + 4 * 31 + 5)
    parts = [(0, torch.randn(97)), (4 * 97, torch.randn(31)), (4 * 128, torch.arange(1.0, 2.0))]
    fd = os.open(path, os.O_WRONLY)
    try:
        written = [("f", offset, t.numel() * 4, inplace._write_part(fd, t, offset))
                   for offset, t in parts]
    finally:
        os.close(fd)
    assert [len(crcs) for *_, crcs in written] == [10, 4, 1]
    pieces = inplace._coalesce(written)
    with open(path, "rb") as file:
        data = file.read()
    assert pieces == [Piece("f", 0, 4 * 129, zlib.crc32(data[: 4 * 129]))]


def test_only_long_pieces_start_their_writeback(tmp_path: Any, monkeypatch: Any) -> None:
    """A piece of at least WRITEBACK_MIN_BYTES starts its writeback when written; a short one
    (a step count next to others in one page) is left to fsync (catches either rule lost)."""
    started: list[tuple[int, int]] = []
    monkeypatch.setattr(inplace.durable, "start_writeback",
                        lambda fd, offset, length: started.append((offset, length)))
    monkeypatch.setattr(inplace, "PIECE_BYTES", 400)  # 100 fp32 elements per piece
    monkeypatch.setattr(inplace, "WRITEBACK_MIN_BYTES", 200)
    path = str(tmp_path / "parts.bin")
    with open(path, "wb") as file:
        file.truncate(4 * 250 + 4)
    fd = os.open(path, os.O_WRONLY)
    try:
        inplace._write_part(fd, torch.randn(250), 0)  # pieces of 400, 400, 200 bytes
        inplace._write_part(fd, torch.randn(1), 1000)  # 4 bytes
    finally:
        os.close(fd)
    assert started == [(0, 400), (400, 400), (800, 200)]


def test_tiling_check_names_the_file_and_the_gap() -> None:
    whole = [Piece("a", 0, 10, 0), Piece("a", 10, 5, 0), Piece("b", 0, 4, 0)]
    check_tiling(whole, {"a": 15, "b": 4})
    with pytest.raises(CheckpointError, match=r"a: bytes \[10, 12\) were written by no rank"):
        check_tiling([Piece("a", 0, 10, 0), Piece("a", 12, 3, 0)], {"a": 15})
    with pytest.raises(CheckpointError, match=r"a: bytes \[8, 10\) were written twice"):
        check_tiling([Piece("a", 0, 10, 0), Piece("a", 8, 7, 0)], {"a": 15})
    with pytest.raises(CheckpointError, match=r"a: bytes \[10, 15\) were written by no rank"):
        check_tiling([Piece("a", 0, 10, 0)], {"a": 15})
    with pytest.raises(CheckpointError, match=r"b: bytes \[0, 4\) were written by no rank"):
        check_tiling([Piece("a", 0, 15, 0)], {"a": 15, "b": 4})
    with pytest.raises(CheckpointError, match="past the end"):
        check_tiling([Piece("a", 0, 16, 0)], {"a": 15})


# ---- Gemini at world 2 ----------------------------------------------------------------------
def _gemini(seed: int = 1234) -> tuple[GeminiDDP, GeminiOptimizer]:
    model = make_model(seed)
    gemini = GeminiDDP(model, precision="bf16", chunk_config_dict=dict(CHUNK))
    return gemini, GeminiOptimizer(make_optimizer(model), gemini, initial_scale=2**8)


def _train(gemini: GeminiDDP, opt: GeminiOptimizer, rank: int, world: int) -> None:
    for step in range(2):
        x, y = local_batch(step, rank, world)
        opt.backward(nn.functional.mse_loss(gemini(x).float(), y))
        opt.step()


def _files(root: str) -> dict[str, bytes]:
    """The checkpoint's files (hidden ones, e.g. a failed save's staging folder, left out)."""
    return {n: open(os.path.join(root, n), "rb").read() for n in sorted(os.listdir(root))
            if not n.startswith(".")}


class _NoGather(ChunkGatherer):
    def buffer(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("an in-place save gathered a chunk")


def _save_both_ways(rank: int, world: int, root: str) -> dict[str, Any]:
    gemini, opt = _gemini()
    _train(gemini, opt, rank, world)
    streamed = GeminiCheckpointIO()
    streamed._in_place = lambda manager: False  # type: ignore[method-assign]
    streamed.save_model(gemini, f"{root}/stream/model", shard=True, size_per_shard=SHARD_MB)
    streamed.save_optimizer(opt, f"{root}/stream/optim", shard=True, size_per_shard=SHARD_MB)
    streamed.save_model(gemini, f"{root}/stream/one.safetensors")

    written: list[int] = []
    original_write, original_gatherer = inplace._write_part, ChunkGatherer.buffer
    inplace._write_part = lambda fd, data, offset: (  # type: ignore[assignment]
        written.append(data.numel() * data.element_size())
        or original_write(fd, data, offset))
    ChunkGatherer.buffer = _NoGather.buffer  # type: ignore[method-assign]
    try:
        io = GeminiCheckpointIO()
        io.save_model(gemini, f"{root}/inplace/model", shard=True, size_per_shard=SHARD_MB)
        io.save_optimizer(opt, f"{root}/inplace/optim", shard=True, size_per_shard=SHARD_MB)
        io.save_model(gemini, f"{root}/inplace/one.safetensors")  # one file, no index
    finally:
        inplace._write_part = original_write  # type: ignore[assignment]
        ChunkGatherer.buffer = original_gatherer  # type: ignore[method-assign]

    # A rank that fails mid-save: every rank raises, the committed checkpoint stays.
    def broken(fd: int, data: torch.Tensor, offset: int) -> Any:
        if rank == 1:
            raise OSError("disk full (injected)")
        return original_write(fd, data, offset)

    inplace._write_part = broken  # type: ignore[assignment]
    try:
        io.save_model(gemini, f"{root}/inplace/model", shard=True, size_per_shard=SHARD_MB)
        failed = "no error"
    except (CheckpointError, OSError) as err:
        failed = str(err)
    finally:
        inplace._write_part = original_write  # type: ignore[assignment]
    # After the failure the old checkpoint loads into another model, which saves the same.
    other, other_opt = _gemini(seed=99)
    io.load_model(other, f"{root}/inplace/model")
    io.load_optimizer(other_opt, f"{root}/inplace/optim")
    io.save_model(other, f"{root}/reloaded/model", shard=True, size_per_shard=SHARD_MB)
    io.save_optimizer(other_opt, f"{root}/reloaded/optim", shard=True, size_per_shard=SHARD_MB)
    return {"written": sum(written), "failed": failed}


def test_gemini_in_place_save_is_byte_identical_and_gathers_nothing(tmp_path: Any) -> None:
    root = str(tmp_path)
    results = spawn(_save_both_ways, 2, args=(root,))
    for kind in ("model", "optim"):
        stream, in_place = _files(f"{root}/stream/{kind}"), _files(f"{root}/inplace/{kind}")
        assert sorted(stream) == sorted(in_place)
        assert sum(n.endswith(".safetensors") for n in stream) >= 3, sorted(stream)
        for name, data in stream.items():  # catches a wrong offset, order, header or CRC
            assert in_place[name] == data, f"{kind}/{name} differs from the streamed save"
        reloaded = _files(f"{root}/reloaded/{kind}")  # the failed save changed nothing
        assert reloaded == stream, kind
    one = "one.safetensors"
    assert open(f"{root}/inplace/{one}", "rb").read() == open(f"{root}/stream/{one}", "rb").read()
    # Both ranks wrote, and together exactly the data once (no tensor written twice).
    assert all(r["written"] > 0 for r in results), results
    index = json.loads(_files(f"{root}/stream/model")["model.safetensors.index.json"])
    optim = json.loads(_files(f"{root}/stream/optim")["optimizer.safetensors.index.json"])
    total = index["metadata"]["total_size"] + optim["metadata"]["total_size"]
    assert sum(r["written"] for r in results) == total + index["metadata"]["total_size"]
    assert "rank 1" in results[0]["failed"] and "injected" in results[1]["failed"], results
    assert not [n for n in os.listdir(f"{root}/inplace/model") if n.endswith(".tmp")]


# ---- ranks on different filesystems (catches: a rank writing into a file nobody commits) --
def _save_to_node_local_paths(rank: int, world: int, root: str) -> dict[str, Any]:
    """Each rank passes its own directory, as ranks on different nodes with local disks."""
    gemini, opt = _gemini()
    errors = []
    for shard in (True, False):
        target = os.path.join(root, f"node{rank}", "ckpt" if shard else "one.safetensors")
        try:
            GeminiCheckpointIO().save_model(gemini, target, shard=shard, size_per_shard=SHARD_MB)
            errors.append("no error")
        except CheckpointError as err:
            errors.append(str(err))
    return {"errors": errors, "files": sorted(
        os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)}


def test_in_place_save_needs_a_filesystem_shared_by_the_ranks(tmp_path: Any) -> None:
    results = spawn(_save_to_node_local_paths, 2, args=(str(tmp_path),))
    for result in results:  # every rank fails, sharded or not, naming the cause
        for error in result["errors"]:
            assert "rank 1 does not see" in error and "shared" in error, result
    leftovers = [f for f in results[0]["files"] if f.endswith(".tmp") or "safetensors" in f]
    assert leftovers == [], leftovers  # rank 0 removed the files it created


# ---- a process killed mid-write (catches: a file committed or named before it is complete) ----
_KILL_MID_WRITE = textwrap.dedent(
    """
    import os, sys, torch
    from colossal.checkpoint_io import inplace
    from colossal.booster.plugin.gemini.checkpoint_io import GeminiCheckpointIO
    from colossal.gemini import GeminiDDP

    path = sys.argv[1]
    original, calls = inplace._pwrite_all, []

    def write_then_die(fd, view, offset):
        calls.append(1)
        if len(calls) == 2:
            os._exit(17)  # the process dies between its writes of the file
        original(fd, view, offset)

    inplace._pwrite_all = write_then_die
    model = torch.nn.Linear(64, 64)
    with torch.no_grad():
        model.weight.fill_(7.0)
        model.bias.fill_(7.0)
    gemini = GeminiDDP(model, precision="bf16", chunk_config_dict={"chunk_size": 4096})
    GeminiCheckpointIO().save_model(gemini, path, shard=True, size_per_shard=1)
    os._exit(0)  # reached only if the save wrote fewer than two pieces
    """
)


def test_kill_mid_in_place_save_keeps_the_old_checkpoint(tmp_path: Any) -> None:
    torch.manual_seed(0)
    old = nn.Linear(64, 64)
    path = str(tmp_path / "ckpt")
    io = GeminiCheckpointIO()
    gemini = GeminiDDP(old, precision="bf16", chunk_config_dict={"chunk_size": 4096})
    io.save_model(gemini, path, shard=True, size_per_shard=1)
    expected = {n: p.detach().clone() for n, p in gemini.state_dict().items()}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", _KILL_MID_WRITE, path], env=env,
                          check=False, timeout=300)
    assert done.returncode == 17, "the writer was not killed mid-write"
    assert [n for n in os.listdir(path) if n.endswith(".tmp")]  # killed with a file open
    fresh = GeminiDDP(nn.Linear(64, 64), precision="bf16", chunk_config_dict={"chunk_size": 4096})
    io.load_model(fresh, path)
    for name, value in fresh.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0)
    io.save_model(fresh, path, shard=True, size_per_shard=1)  # succeeds, removes leftovers
    assert not [n for n in os.listdir(path) if n.startswith(".")]


# ---- replicated (DDP) state in place: the ranks share the bytes ------------------------------
def _ddp_save(rank: int, world: int, root: str) -> dict[str, Any]:
    from booster_testlib import make_booster

    from colossal.checkpoint_io import MODEL_INDEX
    from colossal.checkpoint_io.saver import ShardedSaver

    booster = make_booster("ddp")
    model, *_ = booster.boost(make_model())
    state = {n: t.detach() for n, t in model.unwrap().state_dict().items()}
    # The reference: the same tensors streamed, each file by one rank (no in-place code).
    ShardedSaver().save(state, f"{root}/stream", "model", MODEL_INDEX, SHARD_MB, stream=True)
    written: list[int] = []
    original = inplace._write_part
    inplace._write_part = lambda fd, data, offset: (  # type: ignore[assignment]
        written.append(data.numel() * data.element_size()) or original(fd, data, offset))
    try:
        booster.save_model(model, f"{root}/inplace", shard=True, size_per_shard=SHARD_MB)
    finally:
        inplace._write_part = original  # type: ignore[assignment]
    return {"written": sum(written), "total": sum(t.numel() * t.element_size()
                                                    for t in state.values())}


def test_ddp_save_is_written_in_place_by_every_rank(tmp_path: Any) -> None:
    root = str(tmp_path)
    results = spawn(_ddp_save, 2, args=(root,))
    stream, in_place = _files(f"{root}/stream"), _files(f"{root}/inplace")
    assert sum(n.endswith(".safetensors") for n in stream) >= 3, sorted(stream)
    assert sorted(stream) == sorted(in_place)
    for name, data in stream.items():  # catches a wrong offset, order, header or CRC
        assert in_place[name] == data, f"{name} differs from the streamed save"
    total = results[0]["total"]
    assert sum(r["written"] for r in results) == total  # every tensor written once
    for r in results:  # both ranks share the bytes
        assert r["written"] >= total // 4, results


# ---- a failed in-place save removes what it created -------------------------------------------
def _fail_in_place(rank: int, world: int, root: str) -> dict[str, Any]:
    from booster_testlib import make_booster

    booster = make_booster("ddp")
    model, *_ = booster.boost(make_model())
    existing = f"{root}/existing"
    booster.save_model(model, existing, shard=True, size_per_shard=SHARD_MB)
    original = inplace._write_part

    def broken(fd: int, data: torch.Tensor, offset: int) -> Any:
        if rank == 1:
            raise OSError("disk full (injected)")
        return original(fd, data, offset)

    errors = []
    inplace._write_part = broken  # type: ignore[assignment]
    try:
        for save in (
            lambda: booster.save_model(model, f"{root}/new/a/ckpt", shard=True,
                                       size_per_shard=SHARD_MB),
            lambda: booster.save_model(model, f"{root}/file/b/one.safetensors"),
            lambda: booster.save_model(model, existing, shard=True, size_per_shard=SHARD_MB),
        ):
            if rank == 0:
                listing = sorted(os.listdir(existing))
            try:
                save()
                errors.append("no error")
            except (CheckpointError, OSError) as err:
                errors.append(str(err))
            torch.distributed.barrier()
    finally:
        inplace._write_part = original  # type: ignore[assignment]
    return {"errors": errors, "listing": listing if rank == 0 else None}


def test_failed_in_place_save_removes_what_it_created(tmp_path: Any) -> None:
    """A directory the save created (and its files) is gone; an existing one is untouched."""
    root = str(tmp_path)
    with open(f"{root}/mine.txt", "w") as file:
        file.write("the user's")
    os.makedirs(f"{root}/existing")
    with open(f"{root}/existing/notes.txt", "w") as file:
        file.write("the user's")
    before = {n: open(f"{root}/existing/{n}", "rb").read()
              for n in os.listdir(f"{root}/existing")}
    results = spawn(_fail_in_place, 2, args=(root,))
    for rank, result in enumerate(results):  # every save failed on every rank
        assert len(result["errors"]) == 3, result
        for error in result["errors"]:
            assert ("rank 1" if rank == 0 else "injected") in error, (rank, error)
    assert sorted(os.listdir(root)) == ["existing", "mine.txt"]  # new/ and file/ are gone
    after = {n: open(f"{root}/existing/{n}", "rb").read()
             for n in os.listdir(f"{root}/existing")}
    assert sorted(after) == results[0]["listing"]  # nothing of the failed save is left
    assert after["notes.txt"] == before["notes.txt"]
    fresh = make_model(seed=5)
    from colossal.booster import Booster

    Booster().load_model(fresh, f"{root}/existing")  # the committed checkpoint still loads
    for name, value in make_model().state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[name], value, rtol=0, atol=0)


# ---- durability: every file fsynced before its rename, the renames before the commit -------
def test_in_place_files_are_durable_before_their_rename_and_the_commit(
    tmp_path: Any, monkeypatch: Any
) -> None:
    """Catches a rename or commit that a power loss could leave pointing at unwritten
    bytes: a temporary file renamed before its fsync, or the index written before the
    renames are durable (the directory fsync)."""
    from colossal.booster import Booster

    events: list[tuple[str, str]] = []
    fsync, fsync_directory = os.fsync, inplace.durable.fsync_directory
    rename, commit = inplace._rename, inplace.commit_index

    def spy_fsync(fd: int) -> None:
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(inplace.durable, "fsync_directory",
                        lambda d: events.append(("fsync_dir", "")) or fsync_directory(d))
    monkeypatch.setattr(inplace, "_rename", lambda a, b: events.append(
        ("rename", os.path.basename(a))) or rename(a, b))
    monkeypatch.setattr(inplace, "commit_index", lambda *a: events.append(("commit", ""))
                        or commit(*a))
    booster = Booster()
    model, *_ = booster.boost(make_model())
    booster.save_model(model, str(tmp_path / "ckpt"), shard=True, size_per_shard=SHARD_MB)
    renames = [i for i, (kind, _) in enumerate(events) if kind == "rename"]
    assert len(renames) >= 3, events
    for i in renames:
        assert ("fsync", events[i][1]) in events[:i], (events[i], events)
    commit_at = events.index(("commit", ""))
    assert ("fsync_dir", "") in events[renames[-1]:commit_at], events


def test_extra_files_named_like_checkpoint_files_fail_before_anything_is_written(
    tmp_path: Any,
) -> None:
    """Refused by rank 0's plan (so on every rank), and the directory it made is gone."""
    from colossal.checkpoint_io import MODEL_INDEX
    from colossal.checkpoint_io.saver import ShardedSaver

    target = tmp_path / "new" / "ckpt"
    tensors = {"w": torch.ones(4)}
    for in_place in (True, False):
        with pytest.raises(ValueError, match="would overwrite checkpoint files"):
            ShardedSaver().save(tensors, str(target), "model", MODEL_INDEX, 1024,
                                extra_files={MODEL_INDEX: "{}"}, in_place=in_place)
        assert os.listdir(tmp_path) == []
