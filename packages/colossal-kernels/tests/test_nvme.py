from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from colossal.core.io import direct_io_supported
from colossal.kernels import REGISTRY, CPUAdam, HybridAdam
from colossal.kernels.optim import _nvme

SIZES = [5000, 1200, 7000, 300, 2500, 4000]


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=g)) for n in SIZES]


def _grads(step):
    g = torch.Generator().manual_seed(10 + step)
    return [torch.randn(n, generator=g).bfloat16() for n in SIZES]


def _files(opt):
    if opt._store is None or opt._store.closed:
        return []
    opt._store.flush()  # writes are asynchronous
    return sorted(os.listdir(opt._store.directory))


@pytest.mark.parametrize("unit", [None, 2048])  # all in one unit / params split and packed
@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("impl", ["cpp", "torch"])
@pytest.mark.parametrize("cls", [CPUAdam, HybridAdam])
def test_offload_is_bit_identical(tmp_path, monkeypatch, impl, cls, direct, unit):
    if direct and not direct_io_supported(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    monkeypatch.setattr(_nvme, "UNIT_NUMEL", unit or _nvme.UNIT_NUMEL)
    plain, off = _params(), _params()
    o1 = cls(plain, lr=1e-2, weight_decay=0.1)
    o2 = cls(off, lr=1e-2, weight_decay=0.1, nvme_offload_fraction=0.5,
             nvme_offload_dir=str(tmp_path), nvme_direct_io=direct)
    assert o2._store.direct_io is direct
    copies = [torch.empty_like(p, dtype=torch.bfloat16) for p in off]
    o2.attach_working_params(dict(zip(off, copies, strict=False)))
    with REGISTRY.force("cpu_adam", impl):
        for step in range(5):
            grads = _grads(step)
            o1.step(div_scale=4.0, grads=dict(zip(plain, grads, strict=False)))
            o2.step(div_scale=4.0, grads=dict(zip(off, grads, strict=False)))
    offloaded = o2.offloaded_params
    numel = sum(p.numel() for p in offloaded)
    assert 0.3 * sum(SIZES) <= numel <= 0.7 * sum(SIZES)
    for p in offloaded:
        assert "exp_avg" not in o2.state[p]  # really not in memory
    assert _files(o2) == ["state.bin"]
    layout = o2._store.layout
    assert os.path.getsize(o2._store.path) == layout.file_nbytes
    assert all(u.numel <= layout.capacity for u in layout.units)
    assert len(layout.units) >= (1 if unit is None else 2 * numel // 2048)
    for a, b, c in zip(plain, off, copies, strict=False):
        assert torch.equal(a, b)
        assert torch.equal(c, b.detach().bfloat16())
    sd1, sd2 = o1.state_dict(), o2.state_dict()
    for i in sd1["state"]:
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sd1["state"][i][key], sd2["state"][i][key])
        assert sd1["state"][i]["step"] == sd2["state"][i]["step"] == 5
    directory = o2._store.directory
    o2.close()
    assert not os.path.exists(directory)
    assert os.listdir(tmp_path) == []
    with pytest.raises(RuntimeError, match="closed"):
        o2.step(grads=dict(zip(off, _grads(0), strict=False)))


def test_offloaded_state_dict_loads_back(tmp_path):
    src, dst, ref = _params(), _params(), _params()
    o_src = CPUAdam(src, lr=1e-2, nvme_offload_fraction=1.0, nvme_offload_dir=str(tmp_path))
    o_ref = CPUAdam(ref, lr=1e-2)
    for step in range(2):
        o_src.step(grads=dict(zip(src, _grads(step), strict=False)))
        o_ref.step(grads=dict(zip(ref, _grads(step), strict=False)))
    sd = o_src.state_dict()
    with torch.no_grad():
        for d, s in zip(dst, src, strict=False):
            d.copy_(s)
    o_dst = CPUAdam(dst, lr=1e-2, nvme_offload_fraction=0.5, nvme_offload_dir=str(tmp_path))
    o_dst.load_state_dict(sd)
    for step in range(2, 4):
        o_dst.step(grads=dict(zip(dst, _grads(step), strict=False)))
        o_ref.step(grads=dict(zip(ref, _grads(step), strict=False)))
    for a, b in zip(dst, ref, strict=False):
        assert torch.equal(a, b)
    o_src.close()
    o_dst.close()
    assert os.listdir(tmp_path) == []


def test_files_removed_after_error(tmp_path, monkeypatch):
    params = _params()
    opt = CPUAdam(params, nvme_offload_fraction=0.5, nvme_offload_dir=str(tmp_path))
    opt.step(grads=dict(zip(params, _grads(0), strict=False)))
    assert _files(opt)
    def blow_up(*args, **kwargs):
        raise RuntimeError("kernel blew up")

    monkeypatch.setattr(opt, "_update_unit", blow_up)  # fail inside the offload pipeline
    with pytest.raises(RuntimeError, match="kernel blew up"):
        opt.step(grads=dict(zip(params, _grads(1), strict=False)))
    assert os.listdir(tmp_path) == []
    with pytest.raises(RuntimeError, match="removed after an error"):
        opt.step(grads=dict(zip(params, _grads(2), strict=False)))


def test_files_removed_at_interpreter_exit(tmp_path):
    code = textwrap.dedent(f"""
        import torch
        from colossal.kernels import CPUAdam
        p = torch.nn.Parameter(torch.randn(1000))
        p.grad = torch.randn(1000)
        opt = CPUAdam([p], nvme_offload_fraction=1.0, nvme_offload_dir={str(tmp_path)!r})
        opt.step()
        assert len(__import__("os").listdir({str(tmp_path)!r})) == 1
        KEEP = opt   # still alive at exit
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
    assert os.listdir(tmp_path) == []


def test_bad_offload_dir(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        CPUAdam([torch.nn.Parameter(torch.ones(2))], nvme_offload_fraction=0.5,
                nvme_offload_dir=str(f))


@pytest.mark.parametrize("cost", [0.0, 1e9])  # all cores compute / one core left to the IO
def test_thread_choice_keeps_results_identical(tmp_path, monkeypatch, cost):
    from colossal.kernels.optim import _base, _offload

    monkeypatch.setattr(_offload, "_OVERSUBSCRIBE_COST", cost)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    chosen = []
    choose = _base.AdamBase._offload_threads
    monkeypatch.setattr(_base.AdamBase, "_offload_threads",
                        lambda self: chosen.append(choose(self)) or chosen[-1])
    try:
        plain, off = _params(), _params()
        o1 = CPUAdam(plain, lr=1e-2, weight_decay=0.1)
        o2 = CPUAdam(off, lr=1e-2, weight_decay=0.1, nvme_offload_fraction=0.5,
                     nvme_offload_dir=str(tmp_path))
        for step in range(4):
            grads = _grads(step)
            o1.step(grads=dict(zip(plain, grads, strict=False)))
            o2.step(grads=dict(zip(off, grads, strict=False)))
            o2._store.flush()  # the step's write-back is measured before the next choice
        assert o2._store.io_cpu_seconds > 0.0
        o2.close()
    finally:
        torch.set_num_threads(threads)
    # The first step leaves a core to the IO (nothing measured yet); then the measurements
    # decide: a zero cost means all cores compute, a huge one always leaves a core free.
    assert chosen == [1] + ([None] * 3 if cost == 0.0 else [1] * 3)
    for a, b in zip(plain, off, strict=False):
        assert torch.equal(a, b)
    assert os.listdir(tmp_path) == []


def test_io_goes_through_core_tensor_file_io_and_errors_propagate(tmp_path):
    from colossal.core.io import TensorFileIO

    params = _params()
    opt = CPUAdam(params, nvme_offload_fraction=0.5, nvme_offload_dir=str(tmp_path))
    assert isinstance(opt._store._io, TensorFileIO)
    opt.step(grads=dict(zip(params, _grads(0), strict=False)))
    files = _files(opt)
    assert files
    with open(os.path.join(opt._store.directory, files[0]), "r+b") as fh:
        fh.truncate(12)  # the state file lost its tail
    opt._store.take_prefetched(opt._store.layout.units[: _nvme.DEPTH - 1])  # step 1 reads
    with pytest.raises(ValueError, match="truncated"):
        opt.step(grads=dict(zip(params, _grads(1), strict=False)))
    assert os.listdir(tmp_path) == []  # removed after the error
    assert opt._store._io.closed


def test_direct_io_is_the_default_where_supported_and_required_on_request(tmp_path, monkeypatch):
    store = _nvme.NVMeStateStore(tmp_path)
    assert store.direct_io is direct_io_supported(store.directory)
    # a state round-trips whatever its size; the unit is padded to whole blocks
    exp_avg, exp_avg_sq = torch.randn(1001), torch.randn(1001)
    store.add(0, 1001)
    store.write_states({0: (exp_avg, exp_avg_sq)})
    got = store.read_states([0])[0]
    assert torch.equal(got[0], exp_avg) and torch.equal(got[1], exp_avg_sq)
    assert os.path.getsize(store.path) == store.layout.file_nbytes == 8192
    store.close()
    monkeypatch.setattr(_nvme, "direct_io_supported", lambda directory: False)
    fallback = _nvme.NVMeStateStore(tmp_path)
    assert fallback.direct_io is False  # falls back to buffered IO
    fallback.close()
    with pytest.raises(ValueError, match="nvme_direct_io=True .* refuses O_DIRECT"):
        CPUAdam([torch.nn.Parameter(torch.ones(2))], nvme_offload_fraction=0.5,
                nvme_offload_dir=str(tmp_path), nvme_direct_io=True)
    assert os.listdir(tmp_path) == []  # the refused store left nothing behind



def _resident_pages(path: str) -> int:
    """Pages of ``path`` in the page cache (``mincore`` over a private mapping of it)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    size = os.path.getsize(path)
    vec = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_COPY) as mm:
        first = ctypes.c_char.from_buffer(mm)  # the mapping's address (nothing is touched)
        failed = libc.mincore(ctypes.c_void_p(ctypes.addressof(first)), ctypes.c_size_t(size),
                              vec)
        del first  # release the buffer export before the mapping closes
    if failed:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(v & 1 for v in vec)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore is Linux-specific")
@pytest.mark.parametrize("direct", [True, False])
def test_direct_io_keeps_the_state_out_of_memory(tmp_path, direct):
    """With O_DIRECT the offloaded state is on the device only; buffered, the page cache
    keeps it (which is why direct IO is the default)."""
    if direct and not direct_io_supported(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    params = _params()
    opt = CPUAdam(params, nvme_offload_fraction=0.5, nvme_offload_dir=str(tmp_path),
                  nvme_direct_io=direct)
    for step in range(2):
        opt.step(grads=dict(zip(params, _grads(step), strict=False)))
    paths = [os.path.join(opt._store.directory, f) for f in _files(opt)]
    assert paths
    resident = sum(_resident_pages(p) for p in paths)
    opt.close()
    if direct:
        assert resident == 0
    else:
        assert resident > 0


def test_late_grads_and_bounded_buffers(tmp_path, monkeypatch):
    """Params first stepped in a later step (their units read as zeros, or hold pieces of
    params without grads that must survive), with units far smaller than the largest param:
    still bit-identical, and the ring buffers hold units, not whole params."""
    monkeypatch.setattr(_nvme, "UNIT_NUMEL", 2048)
    plain, off = _params(), _params()
    o1 = CPUAdam(plain, lr=1e-2, weight_decay=0.1)
    o2 = CPUAdam(off, lr=1e-2, nvme_offload_fraction=1.0, nvme_offload_dir=str(tmp_path),
                 weight_decay=0.1)
    for step in range(5):
        grads = _grads(step)
        late = {1: 2, 3: 1, 4: 3}  # param index -> first step with a grad
        keep = [i for i in range(len(SIZES)) if step >= late.get(i, 0)]
        o1.step(grads={plain[i]: grads[i] for i in keep})
        o2.step(grads={off[i]: grads[i] for i in keep})
    for a, b in zip(plain, off, strict=True):
        assert torch.equal(a, b)
    sd1, sd2 = o1.state_dict(), o2.state_dict()
    for i in sd1["state"]:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch.as_tensor(sd1["state"][i][key]),
                               torch.as_tensor(sd2["state"][i][key]))
    buffers = o2._store._buffers
    assert buffers and all(b.numel() == 2048 for b in buffers)
    assert 2 * max(SIZES) > 3 * 2048  # a ring of whole params would have been larger
    o2.close()


def test_next_steps_first_units_are_read_ahead(tmp_path, monkeypatch):
    """After a step, the first units are read again behind its writes; the next step starts
    with them (no new read), and results stay identical, also when a load in between makes
    them stale."""
    monkeypatch.setattr(_nvme, "UNIT_NUMEL", 2048)
    plain, off = _params(), _params()
    o1 = CPUAdam(plain, lr=1e-2)
    o2 = CPUAdam(off, lr=1e-2, nvme_offload_fraction=1.0, nvme_offload_dir=str(tmp_path))
    reads: list[int] = []
    real_read = o2._store._io.read_into

    def counting(path, out, offset=0, **kwargs):
        reads.append(offset)
        return real_read(path, out, offset, **kwargs)

    monkeypatch.setattr(o2._store._io, "read_into", counting)
    for step in range(4):
        grads = _grads(step)
        o1.step(grads=dict(zip(plain, grads, strict=False)))
        before = len(reads)
        o2.step(grads=dict(zip(off, grads, strict=False)))
        units = o2._store.layout.units
        ahead = [u.offset for u in units[: _nvme.DEPTH - 1]]
        if step == 0:  # nothing to read yet; then the first units are read for step 1
            assert reads == ahead
        else:  # the prefetched units are not read again; the rest, then the next 2
            assert reads[before:] == [u.offset for u in units[len(ahead) :]] + ahead
        if step == 1:  # a load rewrites the file: the read-ahead is dropped, not used
            o2.load_state_dict(o1.state_dict())
            reads.clear()
            o2.step(grads=dict(zip(off, _grads(9), strict=False)))
            o1.step(grads=dict(zip(plain, _grads(9), strict=False)))
            assert reads[: len(units)] == [u.offset for u in units]
    for a, b in zip(plain, off, strict=True):
        assert torch.equal(a, b)
    o2.close()
