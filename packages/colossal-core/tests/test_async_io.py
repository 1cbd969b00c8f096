"""Tests of colossal.core.io: safetensors round trips, crash safety, partial and async reads."""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
from safetensors import safe_open

import colossal.core
import colossal.core.io._atomic_file as atomic_mod
import colossal.core.io.reader as reader_mod
import colossal.core.io.writer as writer_mod
from colossal.core.io import (
    AsyncTensorReader,
    AsyncTensorWriter,
    load_safetensors,
    load_safetensors_async,
    read_safetensors_header,
    read_tensor_slice,
    save_safetensors,
    save_safetensors_async,
)

SRC_ROOT = str(Path(colossal.core.__file__).parents[2])


def sample_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(6, 8, generator=gen)
    return {
        "fp32": base,
        "fp16": base.half() * 3,
        "bf16": base.bfloat16() - 1,
        "int64": torch.arange(-5, 7, dtype=torch.int64).reshape(3, 4),
        "bool": base > 0,
        "uint8": torch.arange(250, 256, dtype=torch.uint8),
        "fp64": base.double()[:2],
        "scalar": torch.tensor(3.5),
        "scalar_int": torch.tensor(-7, dtype=torch.int32),
        "empty": torch.empty(0, 5),
        "empty_bf16": torch.empty(2, 0, dtype=torch.bfloat16),
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "expanded": torch.arange(3.0).reshape(3, 1).expand(3, 4),
        "large": torch.randn(512, 1024, generator=gen),  # 2 MiB: spans many write chunks
        "large_t": torch.randn(300, 70, generator=gen).t(),
    }


def assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(actual) == list(expected) or sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype, name
        assert actual[name].shape == tensor.shape, name
        assert torch.equal(actual[name], tensor), name


def temp_files(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if p.name.endswith(".tmp")]


@pytest.fixture
def writer():
    with AsyncTensorWriter(chunk_bytes=1024) as w:
        yield w


def slow_chunks(monkeypatch, delay: float, fail_after: int | None = None) -> list[int]:
    """Make every chunk write sleep ``delay`` s (and raise after ``fail_after`` calls)."""
    sizes: list[int] = []
    original = atomic_mod._write_chunk

    async def patched(file, data):
        if fail_after is not None and len(sizes) >= fail_after:
            raise OSError("disk full (injected by the test)")
        await asyncio.sleep(delay)
        sizes.append(len(data))
        await original(file, data)

    monkeypatch.setattr(atomic_mod, "_write_chunk", patched)
    return sizes


@pytest.mark.parametrize("mode", ["copy", "background", "nocopy", "sync", "module_async"])
def test_round_trip_all_dtypes_readable_by_safetensors(tmp_path, writer, mode):
    tensors, meta = sample_tensors(), {"format": "pt", "step": "12"}
    path = tmp_path / "x.safetensors"
    if mode == "sync":
        assert save_safetensors(tensors, path, meta) == str(path)
    elif mode == "module_async":
        assert save_safetensors_async(tensors, path, meta).wait() == str(path)
    else:
        handle = writer.save(
            tensors, path, meta, copy=mode != "nocopy", background_copy=mode == "background"
        )
        assert handle.wait(timeout=30) == str(path) and handle.done() and handle.released()
    assert_same(safetensors.torch.load_file(path), tensors)
    assert_same(load_safetensors(path), tensors)
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == meta
    assert read_safetensors_header(path).metadata == meta
    assert temp_files(tmp_path) == []


def test_header_layout_and_empty_dict(tmp_path):
    path = tmp_path / "x.safetensors"
    save_safetensors({"b": torch.ones(3, dtype=torch.int16), "a": torch.ones(2)}, path)
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    assert length % 8 == 0 and raw[8 : 8 + length].decode().rstrip(" ").endswith("}")
    header = json.loads(raw[8 : 8 + length])
    assert header == {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "I16", "shape": [3], "data_offsets": [8, 14]},
    }
    assert len(raw) == 8 + length + 14
    save_safetensors({}, tmp_path / "empty.safetensors")
    assert safetensors.torch.load_file(tmp_path / "empty.safetensors") == {}
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


def test_reads_files_written_by_safetensors(tmp_path):
    tensors = {k: v.contiguous() for k, v in sample_tensors().items()}
    path = tmp_path / "ref.safetensors"
    safetensors.torch.save_file(tensors, path, metadata={"k": "v"})
    assert_same(load_safetensors(path), tensors)
    assert_same(load_safetensors_async(path).wait(timeout=30), tensors)
    assert read_safetensors_header(path).metadata == {"k": "v"}
    assert torch.equal(read_tensor_slice(path, "bf16", (slice(1, 4), 2)), tensors["bf16"][1:4, 2])


def test_caller_may_mutate_after_save_in_default_mode(tmp_path, monkeypatch):
    slow_chunks(monkeypatch, delay=0.1)  # the write surely happens after the mutation
    writer = AsyncTensorWriter()
    original = torch.arange(4096, dtype=torch.float32)
    tensor, view = original.clone(), original.clone().reshape(64, 64).t()
    handle = writer.save({"t": tensor, "v": view}, tmp_path / "safe.safetensors")
    tensor.fill_(-1.0)
    view.zero_()
    handle.wait(timeout=30)
    loaded = load_safetensors(tmp_path / "safe.safetensors")
    assert torch.equal(loaded["t"], original)
    assert torch.equal(loaded["v"], original.reshape(64, 64).t())
    # control: without the snapshot the same mutation is visible, so the check above can fail
    tensor = original.clone()
    handle = writer.save({"t": tensor}, tmp_path / "unsafe.safetensors", copy=False)
    tensor.fill_(-1.0)
    handle.wait(timeout=30)
    writer.close()
    assert torch.equal(load_safetensors(tmp_path / "unsafe.safetensors")["t"], tensor)


def test_background_snapshot_returns_first_and_releases_before_the_write(
    tmp_path, monkeypatch
):
    slow_chunks(monkeypatch, delay=0.2)  # the file write takes a while
    copied = threading.Event()
    go = threading.Event()
    original_stage = writer_mod.stage_tensors

    def gated_stage(*args):  # the snapshot starts only when the test lets it
        assert go.wait(30)
        original_stage(*args)
        copied.set()

    monkeypatch.setattr(writer_mod, "stage_tensors", gated_stage)
    original = torch.arange(1 << 16, dtype=torch.float32)
    tensor = original.clone()
    with AsyncTensorWriter() as writer:
        handle = writer.save({"t": tensor}, tmp_path / "bg.safetensors", background_copy=True)
        assert not handle.released() and not copied.is_set()  # save returned before copying
        with pytest.raises(TimeoutError, match="still being read"):
            handle.wait_released(timeout=0.05)
        go.set()
        handle.wait_released(timeout=30)
        assert copied.is_set() and not handle.done()  # released while the file is written
        tensor.fill_(-1.0)  # allowed now: the snapshot is taken
        handle.wait(timeout=30)
    assert torch.equal(load_safetensors(tmp_path / "bg.safetensors")["t"], original)


def test_background_snapshot_error_fails_the_write(tmp_path, monkeypatch):
    def broken(*args):
        raise RuntimeError("snapshot failed (injected)")

    monkeypatch.setattr(writer_mod, "stage_tensors", broken)
    with AsyncTensorWriter() as writer:
        path = tmp_path / "bad.safetensors"
        handle = writer.save({"t": torch.ones(8)}, path, background_copy=True)
        with pytest.raises(RuntimeError, match="injected"):
            handle.wait_released(timeout=30)
        with pytest.raises(RuntimeError, match="injected"):
            handle.wait(timeout=30)
    assert not path.exists() and temp_files(tmp_path) == []


def test_chunked_writes_and_small_tensor_batching(tmp_path, monkeypatch):
    sizes = slow_chunks(monkeypatch, delay=0)
    big = tmp_path / "big.safetensors"
    with AsyncTensorWriter(chunk_bytes=1 << 20) as w:
        w.save({"big": torch.zeros(7 << 17)}, big).wait()  # 3.5 MiB
    # the staged file image (header + data) is written in whole 4 KiB blocks, then truncated
    assert sizes == [1 << 20] * 3 + [(1 << 19) + 4096]
    assert big.stat().st_size == read_safetensors_header(big).data_start + (7 << 19)
    tensors = {f"s{i}": torch.full((256,), float(i)) for i in range(100)}
    for direct_io in (True, False):  # packed in a bounce buffer / written from the tensors
        sizes.clear()
        path = tmp_path / f"small-{direct_io}.safetensors"
        with AsyncTensorWriter(chunk_bytes=1 << 20, direct_io=direct_io) as w:
            w.save(tensors, path, copy=False).wait()
        size = read_safetensors_header(path).data_start + 100 * 1024
        assert sizes == [-(-size // 4096) * 4096 if direct_io else size]  # a single write
        assert path.stat().st_size == size
        assert_same(load_safetensors(path), tensors)


def test_direct_io_is_used_and_falls_back_when_unsupported(tmp_path, monkeypatch):
    opens, failed_writes = [], []
    original_open, original_write = atomic_mod._direct_opener, atomic_mod._write_chunk

    def opener(path, flags):  # the 2nd file cannot be opened with O_DIRECT
        opens.append(path)
        if len(opens) == 2:
            raise OSError(errno.EINVAL, "O_DIRECT unsupported (injected by the test)")
        return original_open(path, flags)

    async def write(file, data):  # the 3rd file's first O_DIRECT write is rejected
        if len(opens) == 3 and not failed_writes:
            failed_writes.append(len(data))
            raise OSError(errno.EINVAL, "misaligned (injected by the test)")
        await original_write(file, data)

    monkeypatch.setattr(atomic_mod, "_direct_opener", opener)
    monkeypatch.setattr(atomic_mod, "_write_chunk", write)
    tensors = sample_tensors()
    with AsyncTensorWriter(chunk_bytes=4096) as w:
        for name, copy in (
            ("direct", True),
            ("open_fails", False),
            ("write_fails", True),
            ("direct_nocopy", False),
        ):
            path = w.save(tensors, tmp_path / name, copy=copy).wait()
            assert_same(load_safetensors(path), tensors)
    with AsyncTensorWriter(direct_io=False) as w:
        assert_same(load_safetensors(w.save(tensors, tmp_path / "buffered").wait()), tensors)
    assert len(opens) == 4 and failed_writes == [4096]
    assert temp_files(tmp_path) == []


def test_staging_reuse_and_concurrent_saves(tmp_path, monkeypatch):
    slow_chunks(monkeypatch, delay=0.05)  # the three saves below overlap
    with AsyncTensorWriter() as w:
        first = {"x": torch.full((1 << 16,), 1.0)}
        w.save(first, tmp_path / "1.safetensors").wait()
        assert 1 << 18 <= w.staging_bytes < 2 << 18
        values = [torch.full((1 << 16,), float(i)) for i in range(3)]
        handles = [w.save({"x": v}, tmp_path / f"c{i}") for i, v in enumerate(values)]
        for value, handle in zip(values, handles, strict=True):
            assert torch.equal(load_safetensors(handle.wait())["x"], value)
        assert 3 << 18 <= w.staging_bytes < 4 << 18
        w.release_staging()
        assert w.staging_bytes == 0
    assert_same(load_safetensors(tmp_path / "1.safetensors"), first)


@pytest.mark.parametrize("copy", [True, False])
def test_failure_mid_write_keeps_old_file_and_removes_temp(tmp_path, writer, monkeypatch, copy):
    old = {"w": torch.arange(10.0)}
    existing, fresh = tmp_path / "existing.safetensors", tmp_path / "fresh.safetensors"
    save_safetensors(old, existing)
    sizes = slow_chunks(monkeypatch, delay=0, fail_after=3)
    big = {"w": torch.ones(1 << 14)}  # 64 KiB: 64 chunks of 1 KiB, fails after 3
    for path in (existing, fresh):
        sizes.clear()
        with pytest.raises(OSError, match="disk full"):
            writer.save(big, path, copy=copy).wait(timeout=30)
        assert len(sizes) == 3
    assert_same(load_safetensors(existing), old)
    assert not fresh.exists()
    assert temp_files(tmp_path) == []


def test_cancel_on_close_removes_temp(tmp_path, monkeypatch):
    slow_chunks(monkeypatch, delay=0.05)
    w = AsyncTensorWriter(chunk_bytes=1024)
    handle = w.save({"w": torch.ones(1 << 12)}, tmp_path / "x.safetensors")
    with pytest.raises(TimeoutError, match="not finished"):
        handle.wait(timeout=0.05)
    assert not handle.done()
    w.close(wait=False)
    with pytest.raises(concurrent.futures.CancelledError):
        handle.wait(timeout=10)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RuntimeError, match="closed"):
        w.save({"w": torch.ones(1)}, tmp_path / "y.safetensors")


KILLED_WRITER = r"""
import asyncio, sys, torch
import colossal.core.io._atomic_file as atomic
from colossal.core.io import AsyncTensorWriter
original = atomic._write_chunk
async def slow(file, data):
    await asyncio.sleep(0.01)
    await original(file, data)
atomic._write_chunk = slow
with AsyncTensorWriter(chunk_bytes=1 << 20) as w:  # 300 chunks of 1 MiB, ~3 s
    w.save({"big": torch.full((300 << 18,), 7.0)}, sys.argv[1]).wait()
print("finished")
"""

EXIT_WITHOUT_WAIT = r"""
import asyncio, sys, torch
import colossal.core.io._atomic_file as atomic
from colossal.core.io import AsyncTensorWriter
original = atomic._write_chunk
async def slow(file, data):
    await asyncio.sleep(0.02)
    await original(file, data)
atomic._write_chunk = slow
AsyncTensorWriter(chunk_bytes=1024).save({"x": torch.arange(4096, dtype=torch.int32)}, sys.argv[1])
"""


def run_script(script: str, *args: str) -> subprocess.Popen:
    pythonpath = os.pathsep.join([SRC_ROOT, os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": pythonpath}
    command = [sys.executable, "-c", script, *args]
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)


def test_sigkill_mid_write_leaves_old_file_intact(tmp_path):
    path = tmp_path / "model.safetensors"
    old = {"big": torch.arange(5.0)}
    save_safetensors(old, path)
    proc = run_script(KILLED_WRITER, str(path))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        tmps = list(tmp_path.glob(".model.safetensors.*.tmp"))
        if tmps and tmps[0].stat().st_size > 8 << 20:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the writer finished or died before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert_same(safetensors.torch.load_file(path), old)
    (partial,) = tmp_path.glob(".model.safetensors.*.tmp")
    with pytest.raises(ValueError, match="out of range"):
        load_safetensors(partial)


def test_pending_write_finishes_at_interpreter_exit(tmp_path):
    path = tmp_path / "x.safetensors"
    proc = run_script(EXIT_WITHOUT_WAIT, str(path))
    assert proc.wait(timeout=60) == 0
    assert torch.equal(load_safetensors(path)["x"], torch.arange(4096, dtype=torch.int32))


SLICES = [
    (slice(2, 5),),
    (slice(1, 9, 3), slice(None, None, 2)),
    (4,),
    (-1, 3),
    (slice(7, 7),),
    (Ellipsis, 1),
    (slice(None), slice(2, 4)),
    (slice(-3, None), -2),
    (),
]


@pytest.mark.parametrize("index", SLICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_slice_reads_equal_slicing_full_tensor(tmp_path, index, dtype):
    full = (torch.arange(10 * 6 * 4) - 100).reshape(10, 6, 4).to(dtype)
    path = tmp_path / "x.safetensors"
    save_safetensors({"x": full, "pad": torch.ones(3)}, path)
    expected = full[index]
    got = read_tensor_slice(path, "x", index)
    assert got.dtype == dtype and got.shape == expected.shape and torch.equal(got, expected)


def test_slice_reads_only_needed_rows(tmp_path, monkeypatch):
    full = torch.randn(100, 256)
    save_safetensors({"x": full, "scalar": torch.tensor(2.0)}, tmp_path / "x.safetensors")
    reads: list[int] = []
    original = reader_mod._read_into
    path = tmp_path / "x.safetensors"

    def counting(file, view, name, key):
        reads.append(len(view))
        original(file, view, name, key)

    monkeypatch.setattr(reader_mod, "_read_into", counting)
    assert torch.equal(read_tensor_slice(path, "x", slice(40, 43)), full[40:43])
    assert reads[-1] == 3 * 256 * 4
    assert torch.equal(read_tensor_slice(path, "scalar", ()), torch.tensor(2.0))
    with pytest.raises(IndexError, match="out of range"):
        read_tensor_slice(path, "x", 100)


def test_async_reader_equals_sync_and_reads_subsets(tmp_path):
    tensors = sample_tensors()
    path = tmp_path / "x.safetensors"
    save_safetensors(tensors, path)
    with AsyncTensorReader(chunk_bytes=1 << 16) as reader:
        assert_same(reader.load(path).wait(timeout=30), load_safetensors(path))
        keys = ["bf16", "scalar", "empty", "int64"]
        subset = reader.load(path, keys).wait(timeout=30)
        assert list(subset) == keys and list(load_safetensors(path, keys)) == keys
        assert_same(subset, {k: tensors[k] for k in keys})


def test_unknown_keys_name_file_and_key(tmp_path):
    path = tmp_path / "x.safetensors"
    save_safetensors({"a": torch.ones(2)}, path)
    for call in (
        lambda: load_safetensors(path, ["a", "nope"]),
        lambda: load_safetensors_async(path, ["nope"]).wait(timeout=30),
        lambda: read_tensor_slice(path, "nope", slice(0, 1)),
    ):
        with pytest.raises(KeyError, match=r"x\.safetensors: no tensor named 'nope'"):
            call()


def with_header(header: dict) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + bytes(64)


CORRUPT = {
    "tiny": (b"abc", "too short"),
    "header_beyond_file": (struct.pack("<Q", 10_000) + b"{}", "beyond the file size"),
    "truncated_data": (None, "out of range"),
    "bad_json": (struct.pack("<Q", 8) + b"{nope!!}", "not valid JSON"),
    "bad_span": (
        with_header({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}),
        "need 12",
    ),
    "bad_dtype": (
        with_header({"a": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}),
        "unknown dtype",
    ),
}
READERS = {
    "load": load_safetensors,
    "header": read_safetensors_header,
    "async": lambda path: load_safetensors_async(path).wait(timeout=30),
    "slice": lambda path: read_tensor_slice(path, "a", 0),
}


@pytest.mark.parametrize("case", list(CORRUPT))
def test_corrupt_or_truncated_files_raise_clear_errors(tmp_path, case):
    content, message = CORRUPT[case]
    path = tmp_path / f"{case}.safetensors"
    save_safetensors({"a": torch.ones(4), "b": torch.ones(2, dtype=torch.int64)}, path)
    path.write_bytes(content if content is not None else path.read_bytes()[:-5])
    for name, read in READERS.items():
        with pytest.raises(ValueError, match=message) as info:
            read(path)
        assert str(path) in str(info.value), name


def test_bad_input_raises_before_writing(tmp_path, writer):
    path = tmp_path / "x.safetensors"
    cases = [
        ({"a": [1, 2]}, None, TypeError, "must be a torch.Tensor"),
        ({1: torch.ones(1)}, None, TypeError, "names must be str"),
        ({"a": torch.ones(1)}, {"k": 1}, TypeError, "metadata must be"),
        ({"a": torch.ones(2).to_sparse()}, None, ValueError, "dense"),
        ({"__metadata__": torch.ones(1)}, None, ValueError, "reserved"),
        ({"a": torch.ones(1, device="meta")}, None, ValueError, "meta device"),
    ]
    for tensors, meta, error, message in cases:
        with pytest.raises(error, match=message):
            writer.save(tensors, path, meta)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        writer.save({"a": torch.ones(1)}, tmp_path / "missing" / "x.safetensors")
    with pytest.raises(ValueError, match="chunk_bytes"):
        AsyncTensorWriter(chunk_bytes=0)
    assert list(tmp_path.iterdir()) == []
