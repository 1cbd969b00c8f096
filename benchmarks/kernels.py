"""colossal-kernels benchmark: CPU Adam vs torch fused AdamW, NVMe-offloaded Adam, attention.

Usage::

    python benchmarks/kernels.py [--quick] [--json PATH] [--params N] [--threads T]
                                  [--only {adam,nvme,attention}] [--isa auto,avx2,...]

Rows (all measured in this one run, interleaved so machine noise hits both sides alike):

* ``torch way``: ``torch.optim.AdamW(fused=True)`` doing the same work as ours: bf16 grad to
  fp32 with the loss-scale divisor, the fused step, a copy into the bf16 working param.
* ``colossal CPUAdam``: one fused pass reading the bf16 grad, dividing by the loss scale,
  updating the fp32 param and moments, writing the bf16 working copy; one row per instruction
  set in ``--isa`` (``auto``: the best this CPU runs; ``avx512``, ``avx2``, ``portable``), all in
  the same rounds; the row and the header name the instruction set each one ran.
* ``torch fused AdamW alone``: the fused step on fp32 grads, for reference.
* ``stream copy``: ``dst.copy_(src)`` on fp32 arrays of the same size (the machine's
  streaming bandwidth, counted as bytes read + written).
* ``stream triad``: ``dst = src + s * src2`` (``torch.add(..., out=)``), counted as 12 bytes
  per element like STREAM. Copy and triad also read each destination line before writing it
  (4 more bytes per element than counted); the Adam rows update their arrays in place, so
  their counted bytes are all the bytes they move.
* NVMe offload (fraction 0.5): step time against compute time (no offload) and the time the
  disk needs for the bytes moved: the read and the write-back of the offloaded states with plain
  positional syscalls, timed in the same round-robin as the steps. Both IO modes run, each
  against the disk time of its own access mode: ``direct`` (``O_DIRECT``, the default where
  the filesystem supports it) and ``buffered`` (through the page cache, for reference).

* attention (1 thread unless ``--threads``): forward + backward of causal attention through
  PyTorch's CPU flash kernel called once with ``is_causal`` (``plain``) against the tiled
  decomposition of :mod:`colossal.kernels.attention.cpu_causal` (``tiled``, per diagonal
  block size), for the per-rank shape of the Ulysses benchmark (B=1, H=2, Hk=1, S=2048,
  D=32, ``(B, S, H, D)`` memory) and for ring attention's causal diagonal block (B=1, H=8,
  Hk=4, S=256, D=32; queries ``(B, S, H, D)``, keys/values ``(B, H, S, D)`` memory).

Goals (for every instruction set measured): ours >= 3.0x the torch way and >= 1.0x torch's
fused AdamW alone on fp32 grads (the same bytes moved); offloaded step (default IO mode) <= 1.25x
max(compute, disk time); tiled causal attention >= 1.05x the plain kernel at the Ulysses
shape.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import itertools
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _pkg in ("colossal-core", "colossal-kernels"):
    _src = ROOT / "packages" / _pkg / "src"
    if _src.is_dir() and str(_src) not in sys.path:
        sys.path.insert(0, str(_src))

import torch  # noqa: E402

from colossal.core.io import direct_io_supported, empty_aligned  # noqa: E402
from colossal.kernels import REGISTRY, CPUAdam, _jit  # noqa: E402
from colossal.kernels.optim._functional import CppAdam  # noqa: E402

LOSS_SCALE = 1024.0
BYTES_PER_PARAM = 2 + 8 + 8 + 8 + 2  # bf16 grad, fp32 param/m/v read+write, bf16 copy


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def interleaved(fns: dict, reps: int, warmup: int = 1) -> dict[str, float]:
    """Median seconds per call of each function, run round-robin.

    The order rotates from one round to the next, so each function follows each other one
    equally often (a virtual disk's speed depends on what ran just before).
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    keys = list(fns)
    times: dict[str, list[float]] = {k: [] for k in keys}
    for rep in range(reps):
        shift = rep % len(keys)
        for k in keys[shift:] + keys[:shift]:
            times[k].append(_timed(fns[k]))
    return {k: statistics.median(v) for k, v in times.items()}


class _PinnedCPUAdam(CPUAdam):
    """CPUAdam whose CPU update is one given kernel (one instruction set per optimizer)."""

    def __init__(self, *args, kernel, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
        super().__init__(*args, **kwargs)
        self._pinned = kernel

    def _kernel_for(self, device: torch.device):  # noqa: ANN202
        return self._pinned


def _cpu_adam(master: torch.nn.Parameter, isa: str) -> CPUAdam:
    """CPUAdam on the registry's choice (``isa == "auto"``) or pinned to one instruction set."""
    if isa == "auto" and REGISTRY.status("cpu_adam", "cpu").implementation != "cpp":
        return CPUAdam([master], lr=1e-3, weight_decay=0.01)  # the torch fallback
    return _PinnedCPUAdam(
        [master],
        lr=1e-3,
        weight_decay=0.01,
        kernel=CppAdam(_jit.load_library(), isa=None if isa == "auto" else isa),
    )


def adam_impl(opt: CPUAdam) -> str:
    """``cpp/<instruction set>`` or the registry's implementation name for ``opt``."""
    kernel = opt._kernel_for(torch.device("cpu"))
    simd = getattr(kernel, "simd", None)
    return f"cpp/{simd}" if simd else REGISTRY.status("cpu_adam", "cpu").implementation


def bench_adam(n: int, reps: int, isas: tuple[str, ...] = ("auto",)) -> tuple[list[dict], dict]:
    """Ours (one optimizer per instruction set in ``isas``) against the torch rows.

    Returns the rows and ``{"ours": {impl: {"vs_torch_way", "vs_torch_fused", "s"}},
    "stream_GBps"}``.
    """
    g = torch.Generator().manual_seed(0)
    init = torch.randn(n, generator=g)
    grad_bf16 = (torch.randn(n, generator=g) * LOSS_SCALE).bfloat16()

    # ours: fp32 master, bf16 working param holding the bf16 grad
    ours: dict[str, tuple[CPUAdam, torch.nn.Parameter, torch.Tensor]] = {}
    for isa in isas:
        master = torch.nn.Parameter(init.clone())
        working = master.detach().bfloat16().requires_grad_()
        working.grad = grad_bf16.clone()
        opt = _cpu_adam(master, isa)
        opt.attach_working_params({master: working})
        ours[adam_impl(opt)] = (opt, master, working)

    # torch: the same work the torch way
    t_master = torch.nn.Parameter(init.clone())
    t_working = t_master.detach().bfloat16()
    t_grad = grad_bf16.clone()
    t_opt = torch.optim.AdamW([t_master], lr=1e-3, weight_decay=0.01, fused=True)

    def torch_way() -> None:
        t_master.grad = t_grad.float().div_(LOSS_SCALE)
        t_opt.step()
        t_working.copy_(t_master.detach())
        t_master.grad = None

    # torch fused alone on fp32 grads
    a_master = torch.nn.Parameter(init.clone())
    a_master.grad = torch.randn(n, generator=g)
    a_opt = torch.optim.AdamW([a_master], lr=1e-3, weight_decay=0.01, fused=True)

    src, src2, dst = torch.randn(n, generator=g), torch.randn(n, generator=g), torch.empty(n)

    res = interleaved(
        {
            **{
                impl: functools.partial(opt.step, div_scale=LOSS_SCALE)
                for impl, (opt, _, _) in ours.items()
            },
            "torch_way": torch_way,
            "torch_fused": a_opt.step,
            "copy": lambda: dst.copy_(src),
            "triad": lambda: torch.add(src, src2, alpha=1.0001, out=dst),
        },
        reps,
    )
    stream_bw = 8 * n / res["copy"]
    rows = []
    for key, name, nbytes in (
        ("torch_way", "torch AdamW(fused) + unscale + bf16 copy", None),
        *(
            (impl, f"colossal CPUAdam ({impl}) fused, bf16 copy", BYTES_PER_PARAM * n)
            for impl in ours
        ),
        ("torch_fused", "torch AdamW(fused) alone, fp32 grads", 28 * n),
        ("copy", "stream copy fp32 (read+write)", 8 * n),
        ("triad", "stream triad fp32 (2 reads + 1 write)", 12 * n),
    ):
        t = res[key]
        rows.append(
            {
                "name": name,
                "params": n,
                "ms": round(1e3 * t, 2),
                "params_per_s": round(n / t) if key not in ("copy", "triad") else None,
                "GB_per_s": round(nbytes / t / 1e9, 1) if nbytes else None,
                "vs_stream": round(nbytes / t / stream_bw, 2) if nbytes else None,
            }
        )
    # correctness spot check: the working copy is the rounded master
    for _, master, working in ours.values():
        assert torch.equal(working.detach(), master.detach().bfloat16())
    out = {
        impl: {
            "vs_torch_way": res["torch_way"] / res[impl],
            "vs_torch_fused": res["torch_fused"] / res[impl],
            "s": res[impl],
        }
        for impl in ours
    }
    return rows, {"ours": out, "stream_GBps": stream_bw / 1e9}


def _disk_io(directory: str, unit_nbytes: list[int], direct: bool):
    """A function doing the file IO of one offloaded step, and a function that cleans up.

    The bound the offload is judged against: plain positional syscalls (``os.preadv`` /
    ``os.pwritev`` on a file kept open, one after the other on the calling thread) reading
    and rewriting in place every unit of the state file, with the store's unit sizes and
    offsets: the bytes the step must move, with no library in between, so a slower store
    cannot raise its own bound. The file is opened the way the store opens it (``O_DIRECT``
    or buffered) and already exists (as for every step after the first); the function is
    timed in the same round-robin as the steps so machine noise hits the bound and the step
    alike. With ``O_DIRECT`` this is the device's bandwidth (about 1.1-2 GB/s read and
    2.2-3.5 GB/s write on the 2-core benchmark VM, varying with its host); buffered, it is
    the page cache's (memory copies on the CPU, about 10 GB/s read+write there).
    """
    folder = tempfile.mkdtemp(prefix="colossal-disk-", dir=directory)
    bufs = [empty_aligned(n // 4).normal_() for n in unit_nbytes]
    views = [memoryview(b.numpy()).cast("B") for b in bufs]
    offsets = list(itertools.accumulate(unit_nbytes, initial=0))[:-1]
    flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0)
    fd = os.open(os.path.join(folder, "state.bin"), flags, 0o600)
    for v, offset in zip(views, offsets, strict=True):  # create it (untimed, like step 1)
        os.pwritev(fd, [v], offset)

    def step_io() -> None:
        for v, offset in zip(views, offsets, strict=True):
            os.preadv(fd, [v], offset)
            os.pwritev(fd, [v], offset)

    def close() -> None:
        os.close(fd)
        shutil.rmtree(folder, ignore_errors=True)

    return step_io, close


def _overlapped(compute, io, side: concurrent.futures.Executor) -> None:
    """``io`` on the ``side`` thread while ``compute`` runs here, with nothing linking them."""
    io_done = side.submit(io)
    compute()
    io_done.result()


def bench_nvme(
    n: int, reps: int, directory: str | None, fraction: float = 0.5
) -> tuple[list[dict], dict]:
    """Offloaded step vs compute and disk time, with ``O_DIRECT`` (if supported) and buffered.

    Each mode is timed in a round-robin of its own (compute, offloaded step, disk IO, and the
    disk IO on a side thread while the plain step runs: the floor this machine allows when
    compute and IO share it), direct first: buffered writes leave dirty pages that the kernel
    writes back later, which would compete for the device with the direct IO measured next
    to them.

    Returns the rows and ``{mode: {"ratio", "identical"}}`` with mode ``"direct"`` (absent if
    the directory's filesystem refuses ``O_DIRECT``) and ``"buffered"``.
    """
    tensors = 20
    size = n // tensors
    g = torch.Generator().manual_seed(1)
    inits = [torch.randn(size, generator=g) for _ in range(tensors)]
    grads = [(torch.randn(size, generator=g) * LOSS_SCALE).bfloat16() for _ in range(tensors)]
    directory = directory or tempfile.gettempdir()

    def make(frac: float, direct: bool = False) -> tuple[CPUAdam, list[torch.nn.Parameter]]:
        masters = [torch.nn.Parameter(t.clone()) for t in inits]
        working = [m.detach().bfloat16().requires_grad_() for m in masters]
        for w, gr in zip(working, grads, strict=False):
            w.grad = gr
        opt = CPUAdam(
            masters,
            lr=1e-3,
            weight_decay=0.01,
            nvme_offload_fraction=frac,
            nvme_offload_dir=directory,
            nvme_direct_io=direct,
        )
        opt.attach_working_params(dict(zip(masters, working, strict=False)))
        return opt, masters

    def off_step(opt: CPUAdam) -> None:
        opt.step(div_scale=LOSS_SCALE)
        opt._store.flush()  # count the write-back of this step too

    rows: list[dict] = []
    out = {}
    for mode in (["direct"] if direct_io_supported(directory) else []) + ["buffered"]:
        plain, p_params = make(0.0)
        opt, o_params = make(fraction, mode == "direct")
        plain.step(div_scale=LOSS_SCALE)  # the same number of steps (bit-identical check)
        off_step(opt)  # the first step picks the offloaded params and creates their files
        unit_nbytes = [u.nbytes for u in opt._store.layout.units]
        disk_io, disk_close = _disk_io(directory, unit_nbytes, mode == "direct")
        side = concurrent.futures.ThreadPoolExecutor(1)
        floor_step = functools.partial(make(0.0)[0].step, div_scale=LOSS_SCALE)
        try:
            res = interleaved(
                {
                    "compute": functools.partial(plain.step, div_scale=LOSS_SCALE),
                    "offload": functools.partial(off_step, opt),
                    "disk": disk_io,
                    "overlap": functools.partial(_overlapped, floor_step, disk_io, side),
                },
                reps,
            )
        finally:
            side.shutdown()
            disk_close()
            opt.close()
        moved = 2 * sum(unit_nbytes)  # read + write of every unit
        identical = all(torch.equal(a, b) for a, b in zip(p_params, o_params, strict=False))
        bound = max(res["compute"], res["disk"])
        ratio = res["offload"] / bound
        rows += [
            {
                "name": f"Adam step, no offload (compute; {mode} round)",
                "params": n,
                "ms": round(1e3 * res["compute"], 2),
            },
            {
                "name": f"disk ({mode}): read+write {moved / 1e6:.0f} MB",
                "params": None,
                "ms": round(1e3 * res["disk"], 2),
                "GB_per_s": round(moved / res["disk"] / 1e9, 2),
            },
            {
                "name": f"floor ({mode}): disk IO on a thread while the plain step runs",
                "params": None,
                "ms": round(1e3 * res["overlap"], 2),
                "vs_bound": round(res["overlap"] / bound, 2),
            },
            {
                "name": f"Adam step, NVMe offload {fraction:.0%} ({mode})",
                "params": n,
                "ms": round(1e3 * res["offload"], 2),
                "vs_bound": round(ratio, 2),
                "identical": identical,
            },
        ]
        out[mode] = {"ratio": ratio, "identical": identical}
    return rows, out


ATTN_SHAPES = (  # (label, B, H, Hk, S, D, queries (B, S, H, D) memory, keys/values too)
    ("Ulysses per-rank", 1, 2, 1, 2048, 32, True, True),
    ("ring causal diagonal", 1, 8, 4, 256, 32, True, False),
)


def bench_attention(reps: int) -> tuple[list[dict], dict]:
    """Causal fwd+bwd: the CPU flash kernel with ``is_causal`` vs the tiled decomposition.

    Returns the rows and ``{label: speedup of the best tiled block size}``.
    """
    from colossal.kernels.attention import (
        causal_block_size,
        causal_flash_backward,
        causal_flash_forward,
    )

    fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    g = torch.Generator().manual_seed(2)
    rows: list[dict] = []
    out: dict[str, float] = {}
    for label, b, h, hk, s, d, q_bshd, kv_bshd in ATTN_SHAPES:

        def make(heads: int, bshd: bool, b=b, s=s, d=d) -> torch.Tensor:
            x = torch.randn(b, s, heads, d, generator=g).transpose(1, 2)
            return x if bshd else x.contiguous()

        q, k, v = make(h, q_bshd), make(hk, kv_bshd), make(hk, kv_bshd)
        dout = make(h, q_bshd)
        scale = d**-0.5

        def plain(q=q, k=k, v=v, dout=dout, scale=scale) -> None:
            o, lse = fwd(q, k, v, 0.0, True, scale=scale)
            bwd(dout, q, k, v, o, lse, 0.0, True, scale=scale)

        def tiled(blk: int, q=q, k=k, v=v, dout=dout, scale=scale) -> None:
            o, lse = causal_flash_forward(q, k, v, scale, blk)
            causal_flash_backward(dout, q, k, v, o, lse, scale, blk)

        blocks = sorted({blk for blk in (64, 128, causal_block_size(s)) if blk and s // blk >= 2})
        fns = {"plain": plain, **{f"tiled {blk}": functools.partial(tiled, blk) for blk in blocks}}
        ref = fwd(q, k, v, 0.0, True, scale=scale)[0]
        err = max(
            (causal_flash_forward(q, k, v, scale, blk)[0] - ref).abs().max().item()
            for blk in blocks
        )
        res = interleaved(fns, reps, warmup=2)
        shape = f"B={b} H={h} Hk={hk} S={s} D={d}"
        for key, t in res.items():
            rows.append(
                {
                    "name": f"causal attention fwd+bwd, {label} ({shape}): {key}",
                    "ms": round(1e3 * t, 2),
                    "speedup": round(res["plain"] / t, 3),
                    "max_err": None if key == "plain" else f"{err:.1e}",
                }
            )
        out[label] = max(res["plain"] / res[k] for k in res if k != "plain")
    return rows, out


def markdown(rows: list[dict]) -> str:
    keys = [
        "name",
        "params",
        "ms",
        "params_per_s",
        "GB_per_s",
        "vs_stream",
        "vs_bound",
        "speedup",
        "max_err",
    ]
    keys = [k for k in keys if any(r.get(k) is not None for r in rows)]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        cells = []
        for k in keys:
            v = r.get(k)
            cells.append("" if v is None else (f"{v:.3g}" if k == "params_per_s" else str(v)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="reduced size, under two minutes")
    parser.add_argument("--json", metavar="PATH", help="write results as JSON")
    parser.add_argument("--params", type=int, default=None, help="parameters (default 50M)")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions")
    parser.add_argument("--threads", type=int, default=None, help="torch/OpenMP threads")
    parser.add_argument("--nvme-dir", default=None, help="directory for offloaded state")
    parser.add_argument(
        "--only",
        choices=("adam", "nvme", "attention"),
        default=None,
        help="run only the CPU Adam, the NVMe offload or the attention rows",
    )
    parser.add_argument(
        "--isa",
        default="auto",
        help="comma-separated CPU Adam instruction sets to time side by side: "
        "auto (the best this CPU runs), avx512, avx2, portable",
    )
    args = parser.parse_args(argv)
    isas = tuple(dict.fromkeys(x.strip().lower() for x in args.isa.split(",") if x.strip()))
    n = args.params or (10_000_000 if args.quick else 50_000_000)
    reps = args.reps or (5 if args.quick else 9)
    if args.threads:
        torch.set_num_threads(args.threads)
    nvme_dir = args.nvme_dir or tempfile.gettempdir()

    rows: list[dict] = []
    goals: list[dict] = []
    stream_gbps = None
    adam_impls: list[str] = []
    if args.only in (None, "adam"):
        adam_rows, adam = bench_adam(n, reps, isas)
        rows += adam_rows
        stream_gbps = round(adam["stream_GBps"], 1)
        adam_impls = list(adam["ours"])
        for impl, res in adam["ours"].items():
            goals.append(
                {
                    "name": f"CPUAdam ({impl}) vs torch fused AdamW doing the same work (x)",
                    "value": round(res["vs_torch_way"], 2),
                    "target": 3.0,
                    "met": res["vs_torch_way"] >= 3.0,
                }
            )
            goals.append(
                {
                    "name": f"CPUAdam ({impl}) vs torch fused AdamW alone, fp32 (x)",
                    "value": round(res["vs_torch_fused"], 2),
                    "target": 1.0,
                    "met": res["vs_torch_fused"] >= 1.0,
                }
            )
    if args.only in (None, "nvme"):
        # More repetitions here: a virtual disk's speed varies from one call to the next.
        nvme_rows, nvme = bench_nvme(n, args.reps or (5 if args.quick else 15), nvme_dir)
        rows += nvme_rows
        for mode, res in nvme.items():  # the goal is on the default mode (direct if possible)
            default = mode == next(iter(nvme))
            goals.append(
                {
                    "name": f"NVMe offload 0.5 step / max(compute, disk time), {mode}"
                    + ("" if default else " (not the default; for reference)"),
                    "value": round(res["ratio"], 2),
                    "target": 1.25 if default else None,
                    "met": (res["ratio"] <= 1.25 and res["identical"]) if default else None,
                }
            )
    if args.only in (None, "attention"):
        threads = torch.get_num_threads()
        if not args.threads:
            torch.set_num_threads(1)  # the per-rank setting of the SP benchmark
        attn_rows, attn = bench_attention(args.reps or (9 if args.quick else 21))
        torch.set_num_threads(threads)
        rows += attn_rows
        speedup = attn[ATTN_SHAPES[0][0]]
        goals.append(
            {
                "name": "tiled causal flash attention fwd+bwd vs the plain CPU kernel, "
                "Ulysses per-rank shape (x)",
                "value": round(speedup, 3),
                "target": 1.05,
                "met": speedup >= 1.05,
            }
        )
    machine = {
        "cpu": _cpu_name(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "stream_copy_GBps": stream_gbps,
        "nvme_dir": nvme_dir,
        "cpu_adam_isa": adam_impls,
    }
    attn_1t = args.only in (None, "attention") and not args.threads
    attn_note = "; attention on 1 thread" if attn_1t else ""
    isa_note = f"; CPU Adam {', '.join(adam_impls)}" if adam_impls else ""
    print(
        f"## colossal-kernels ({'quick' if args.quick else 'full'}; {n / 1e6:.0f}M params, "
        f"{machine['threads']} threads{attn_note}{isa_note}, {machine['cpu']})\n"
    )
    print(markdown(rows))
    print("\n| goal | value | target | met |\n|---|---|---|---|")
    for goal in goals:
        print(f"| {goal['name']} | {goal['value']} | {goal['target']} | {goal['met']} |")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"benchmark": "kernels", "machine": machine, "rows": rows, "goals": goals}, indent=2
            ),
            encoding="utf-8",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
