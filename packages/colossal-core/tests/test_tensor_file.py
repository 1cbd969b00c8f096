from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from colossal.core.io import (
    ALIGNMENT,
    TensorFileIO,
    direct_io_supported,
    empty_aligned,
    read_tensor_file_async,
    write_tensor_file_async,
)


@pytest.mark.parametrize("keep_open", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8])
def test_round_trip_bytes_and_offsets(tmp_path, keep_open, dtype):
    path = tmp_path / "t.bin"
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(1001, generator=g) * 100).to(dtype)
    b = (torch.randn(17, generator=g) * 100).to(dtype)
    with TensorFileIO(keep_open=keep_open) as io:
        assert io.write_from(path, a).result() == a.nbytes
        assert io.write_from(path, b, offset=a.nbytes).result() == b.nbytes
        out_a, out_b = torch.empty_like(a), torch.empty_like(b)
        assert io.read_into(path, out_a).result() == a.nbytes
        assert io.read_into(path, out_b, a.nbytes).result() == b.nbytes
        assert io.cpu_seconds > 0.0
    assert torch.equal(out_a, a) and torch.equal(out_b, b)
    assert path.read_bytes() == bytes(a.view(torch.uint8).tolist() + b.view(torch.uint8).tolist())


def test_write_is_in_place_without_truncation(tmp_path):
    path = tmp_path / "t.bin"
    path.write_bytes(bytes(range(16)))
    with TensorFileIO() as io:
        io.write_from(path, torch.tensor([255, 254], dtype=torch.uint8), offset=4).result()
    assert path.read_bytes() == bytes([0, 1, 2, 3, 255, 254, *range(6, 16)])


def test_operations_run_in_submission_order(tmp_path):
    """Swap file contents through two reused buffers, without waiting in between: a read that
    overtook an earlier write of its buffer (or file) would give a different permutation."""
    n = 300_000
    paths = [tmp_path / f"{i}.bin" for i in range(4)]
    with TensorFileIO(keep_open=True) as io:
        for i, p in enumerate(paths):
            io.write_from(p, torch.full((n,), float(i)))
        b0, b1 = torch.empty(n), torch.empty(n)
        futures = []
        pairs = [(0, 1), (1, 2), (2, 3), (3, 0), (0, 2)] * 2
        for x, y in pairs:
            futures += [io.read_into(paths[x], b0), io.read_into(paths[y], b1),
                        io.write_from(paths[y], b0), io.write_from(paths[x], b1)]
        for f in futures:
            f.result()
        got = []
        for p in paths:
            out = torch.empty(n)
            io.read_into(p, out).result()
            got.append(out)
    expected = [0.0, 1.0, 2.0, 3.0]
    for x, y in pairs:
        expected[x], expected[y] = expected[y], expected[x]
    assert expected != [0.0, 1.0, 2.0, 3.0]
    for o, e in zip(got, expected, strict=True):
        assert torch.equal(o, torch.full((n,), e))


def test_missing_and_truncated_files(tmp_path):
    out = torch.ones(8)
    with TensorFileIO(keep_open=True) as io:
        with pytest.raises(FileNotFoundError):
            io.read_into(tmp_path / "nope.bin", out).result()
        assert io.read_into(tmp_path / "nope.bin", out, missing_ok=True).result() == 0
        assert torch.equal(out, torch.zeros(8))
        io.write_from(tmp_path / "short.bin", torch.ones(4)).result()
        with pytest.raises(ValueError, match="truncated"):
            io.read_into(tmp_path / "short.bin", out).result()
        with pytest.raises(OSError):
            io.write_from(tmp_path / "no-dir" / "x.bin", out).result()
        # errors do not break the queue
        assert io.read_into(tmp_path / "short.bin", torch.empty(4)).result() == 16


def test_bad_arguments(tmp_path):
    with TensorFileIO() as io:
        with pytest.raises(TypeError, match="torch.Tensor"):
            io.read_into(tmp_path / "x", bytearray(4))  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="contiguous CPU tensor"):
            io.write_from(tmp_path / "x", torch.ones(4, 4).t())
        with pytest.raises(ValueError, match="offset"):
            io.write_from(tmp_path / "x", torch.ones(4), offset=-1)
    assert io.closed
    with pytest.raises(RuntimeError, match="closed"):
        io.write_from(tmp_path / "x", torch.ones(4))


def test_release_and_close_close_descriptors(tmp_path):
    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc")
    io = TensorFileIO(keep_open=True)
    before = fds()
    for i in range(5):
        io.write_from(tmp_path / f"{i}.bin", torch.ones(4)).result()
    assert fds() >= before + 5
    io.release(tmp_path / "0.bin").result()
    io.close()
    assert fds() <= before


def test_shared_functions(tmp_path):
    src = torch.arange(10, dtype=torch.int32)
    assert write_tensor_file_async(tmp_path / "s.bin", src).result() == 40
    out = torch.empty(10, dtype=torch.int32)
    read_tensor_file_async(tmp_path / "s.bin", out).result()
    assert torch.equal(out, src)


def test_pending_writes_finish_at_interpreter_exit(tmp_path):
    target = tmp_path / "exit.bin"
    code = textwrap.dedent(f"""
        import torch
        from colossal.core.io import TensorFileIO
        io = TensorFileIO(keep_open=True)
        for i in range(50):  # not waited for
            io.write_from({str(target)!r}, torch.full((100_000,), float(i)), offset=0)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
    data = torch.frombuffer(bytearray(target.read_bytes()), dtype=torch.float32)
    assert torch.equal(data, torch.full((100_000,), 49.0))


# ---- O_DIRECT ---------------------------------------------------------------------------------

def _need_direct(path) -> None:
    if not direct_io_supported(path):
        pytest.skip(f"the filesystem of {path} refuses O_DIRECT")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8, torch.int64])
@pytest.mark.parametrize("numel", [0, 1, 1023, 1024, 300_001])
def test_empty_aligned(dtype, numel):
    t = empty_aligned(numel, dtype)
    assert t.dtype == dtype and t.shape == (numel,) and t.is_contiguous()
    assert t.data_ptr() % ALIGNMENT == 0
    t.fill_(3)  # the memory is usable to the last element
    assert bool((t == 3).all()) and t.untyped_storage().nbytes() >= t.nbytes + ALIGNMENT
    with pytest.raises(ValueError, match="numel=-1"):
        empty_aligned(-1)


def test_direct_io_round_trip_matches_buffered_bytes(tmp_path):
    _need_direct(tmp_path)
    g = torch.Generator().manual_seed(3)
    a = empty_aligned(3 * ALIGNMENT // 4).copy_(torch.randn(3 * ALIGNMENT // 4, generator=g))
    b = empty_aligned(ALIGNMENT, torch.uint8).copy_(
        torch.randint(0, 256, (ALIGNMENT,), generator=g, dtype=torch.uint8))
    path = tmp_path / "d.bin"
    with TensorFileIO(keep_open=True, direct_io=True) as io:
        assert io.direct_io
        assert io.write_from(path, a).result() == a.nbytes
        assert io.write_from(path, b, offset=a.nbytes).result() == b.nbytes
        out_a, out_b = empty_aligned(a.numel()), empty_aligned(b.numel(), torch.uint8)
        assert io.read_into(path, out_b, a.nbytes).result() == b.nbytes
        assert io.read_into(path, out_a).result() == a.nbytes
        with pytest.raises(ValueError, match="truncated"):  # a short direct read is the end
            io.read_into(path, empty_aligned(ALIGNMENT // 4), a.nbytes + b.nbytes).result()
    assert torch.equal(out_a, a) and torch.equal(out_b, b)
    assert path.read_bytes() == a.numpy().tobytes() + b.numpy().tobytes()


def test_direct_io_rejects_unaligned_tensors_and_offsets(tmp_path):
    with TensorFileIO(direct_io=True) as io:
        aligned = empty_aligned(ALIGNMENT // 4)
        with pytest.raises(ValueError, match=r"offset 100 \(remainder 100\)"):
            io.write_from(tmp_path / "x", aligned, offset=100)
        with pytest.raises(ValueError, match=r"byte count 16 .*empty_aligned"):
            io.read_into(tmp_path / "x", empty_aligned(4))
        shifted = empty_aligned(ALIGNMENT // 4 + 1)[1:]
        with pytest.raises(ValueError, match=r"address \d+ \(remainder 4\)"):
            io.write_from(tmp_path / "x", shifted)
    assert not (tmp_path / "x").exists()  # refused before any IO


def test_direct_io_supported_probe(tmp_path, monkeypatch):
    real_open = os.open
    assert direct_io_supported(tmp_path) in (True, False)
    assert os.listdir(tmp_path) == []  # the probe file is gone

    def refusing_open(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    assert direct_io_supported(tmp_path) is False
    assert os.listdir(tmp_path) == []
    monkeypatch.delattr(os, "O_DIRECT", raising=False)
    assert direct_io_supported(tmp_path) is False
    with pytest.raises(ValueError, match="O_DIRECT"):
        TensorFileIO(direct_io=True)
