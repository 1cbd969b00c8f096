"""Async safetensors write (colossal.core.io) against safetensors.torch.save_file + fsync.

Writes the same tensors (fp32, 64 MiB each) with:
  * ``safetensors.torch.save_file`` followed by an fsync of the file (the PyTorch-native peer;
    the caller is blocked for the whole write),
  * ``AsyncTensorWriter.save(..., background_copy=True)``: the mode checkpoints use (the
    snapshot to CPU runs on a background thread; the caller must call the handle's
    ``wait_released()`` before it *modifies* the tensors, e.g. before the next optimizer step,
    and may read them meanwhile, e.g. in forward/backward). The goals are computed from this
    row,
  * ``AsyncTensorWriter.save`` in the default safe mode (snapshot before returning; the staging
    buffer is reused across saves, as in a training loop that checkpoints every N steps),
  * ``AsyncTensorWriter.save(copy=False)`` (no snapshot; the caller must not modify the tensors
    until ``wait()`` returns),
  * the safe mode with buffered writes (``direct_io=False``, page cache instead of O_DIRECT),
  * and once, the very first safe-mode save of a fresh writer (staging memory not yet touched).

Ours also writes to a temporary file, renames it and fsyncs the directory (crash safety), and
uses O_DIRECT where the filesystem allows (``direct_io=True``, the default). For ours it
measures the wall time until ``wait()`` returns, the throughput and the time the calling thread
was blocked inside ``save()``. For the background-copy row it also reports when the tensors
were released (``wait_released()`` called right after ``save()``: the snapshot's duration, which
is the caller's worst-case wait at its fence if it has no reading work to overlap).

Goals (background-copy row): throughput >= 0.9x the plain save's, and caller blocked < 10% of
the write time, where "blocked" is the time inside ``save()`` only: the caller has to wait in
``wait_released()`` only before modifying the tensors, which in a training loop comes after
the forward/backward it overlaps with. The other rows are information: the safe default blocks
for one memcpy of the data (under 10% only where storage is ~10x slower than memory);
``copy=False`` blocks for microseconds but holds the tensors until the write is done.

    python benchmarks/async_io.py [--quick] [--size-mb 1024] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch
from safetensors.torch import save_file

from colossal.core.io import AsyncTensorWriter

PLAIN = "safetensors save_file + fsync"
OURS_BG = "ours, background_copy=True (checkpoint mode; goals)"
OURS_COPY = "ours, copy=True (default, staging reused)"
OURS_NOCOPY = "ours, copy=False"
OURS_COLD = "ours, copy=True, first save (fresh staging)"
OURS_BUFFERED = "ours, copy=True, direct_io=False"


def make_tensors(size_mb: int, tensor_mb: int) -> dict[str, torch.Tensor]:
    count = max(1, size_mb // tensor_mb)
    numel = tensor_mb * 1024 * 1024 // 4
    gen = torch.Generator().manual_seed(0)
    return {f"layer{i:03d}.weight": torch.rand(numel, generator=gen) for i in range(count)}


Sample = tuple[float, float, float]
"""(seconds until the file is durable, seconds blocked in save(), seconds until released)."""


def plain_save(tensors: dict[str, torch.Tensor], path: str) -> Sample:
    start = time.perf_counter()
    save_file(tensors, path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    total = time.perf_counter() - start
    return total, total, total


def ours_save(
    writer: AsyncTensorWriter, copy: bool, background_copy: bool = False
) -> Callable[[dict, str], Sample]:
    def run(tensors: dict[str, torch.Tensor], path: str) -> Sample:
        start = time.perf_counter()
        handle = writer.save(tensors, path, copy=copy, background_copy=background_copy)
        blocked = time.perf_counter() - start
        handle.wait_released()
        released = time.perf_counter() - start
        handle.wait()
        return time.perf_counter() - start, blocked, released

    return run


def measure(run: Callable, tensors: dict, directory: str, tag: str) -> Sample:
    path = os.path.join(directory, f"{tag}.safetensors")
    sample = run(tensors, path)
    os.remove(path)
    return sample


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="256 MiB instead of 1 GiB")
    parser.add_argument("--size-mb", type=int, default=None, help="MiB written per save")
    parser.add_argument("--tensor-mb", type=int, default=64, help="MiB per tensor")
    parser.add_argument("--repeats", type=int, default=3, help="timed saves per method")
    parser.add_argument("--dir", default=None, help="where to write (default: system temp)")
    parser.add_argument("--json", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    size_mb = args.size_mb or (256 if args.quick else 1024)
    torch.set_num_threads(max(1, min(os.cpu_count() or 1, 8)))

    tensors = make_tensors(size_mb, args.tensor_mb)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    directory = tempfile.mkdtemp(prefix="colossal-async-io-", dir=args.dir)
    samples: dict[str, list[Sample]] = {
        PLAIN: [], OURS_BG: [], OURS_COPY: [], OURS_NOCOPY: [], OURS_BUFFERED: []
    }
    try:
        with AsyncTensorWriter() as writer, AsyncTensorWriter(direct_io=False) as buffered:
            samples[OURS_COLD] = [measure(ours_save(writer, True), tensors, directory, "cold")]
            methods = {
                PLAIN: plain_save,
                OURS_BG: ours_save(writer, True, background_copy=True),
                OURS_COPY: ours_save(writer, True),
                OURS_NOCOPY: ours_save(writer, False),
                OURS_BUFFERED: ours_save(buffered, True),
            }
            measure(plain_save, tensors, directory, "warmup")
            measure(methods[OURS_BUFFERED], tensors, directory, "warmup")  # touch its staging
            for repeat in range(args.repeats):
                order = list(methods) if repeat % 2 == 0 else list(reversed(methods))
                for name in order:
                    samples[name].append(measure(methods[name], tensors, directory, "run"))
    finally:
        shutil.rmtree(directory, ignore_errors=True)

    rows = []
    for name in (PLAIN, OURS_BG, OURS_COPY, OURS_NOCOPY, OURS_BUFFERED, OURS_COLD):
        totals = [s[0] for s in samples[name]]
        blocked = [s[1] for s in samples[name]]
        total, block = statistics.median(totals), statistics.median(blocked)
        released = statistics.median(s[2] for s in samples[name])
        rows.append({
            "method": name,
            "size_mib": nbytes / 2**20,
            "repeats": len(totals),
            "total_s": total,
            "total_s_all": totals,
            "throughput_gbs": nbytes / total / 1e9,
            "caller_blocked_s": block,
            "caller_blocked_fraction": block / total,
            "released_s": released,
        })
    by_name = {row["method"]: row for row in rows}
    plain_gbs = by_name[PLAIN]["throughput_gbs"]
    goal_row = by_name[OURS_BG]
    ratio = goal_row["throughput_gbs"] / plain_gbs
    fraction = goal_row["caller_blocked_fraction"]
    goals = [
        {"name": "throughput_ratio (background_copy vs plain)", "value": ratio,
         "target": ">= 0.9", "met": ratio >= 0.9},
        {"name": "caller_blocked_fraction (background_copy, time in save())", "value": fraction,
         "target": "< 0.10", "met": fraction < 0.10},
    ]
    no_overlap = goal_row["released_s"] / goal_row["total_s"]

    print(f"\nasync_io: {nbytes / 2**20:.0f} MiB in {len(tensors)} fp32 tensors, median of "
          f"{args.repeats} (cold: 1 run), {os.cpu_count()} CPUs, torch {torch.__version__}\n")
    print("| method | total (s) | GB/s | vs plain | caller blocked in save() (s) | "
          "blocked / total | tensors released after (s) |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['method']} | {row['total_s']:.3f} | {row['throughput_gbs']:.2f} | "
              f"{row['throughput_gbs'] / plain_gbs:.2f}x | {row['caller_blocked_s']:.3f} | "
              f"{100 * row['caller_blocked_fraction']:.1f}% | {row['released_s']:.3f} |")
    print("\n| goal (from the background_copy row) | value | target | met |")
    print("|---|---|---|---|")
    for goal in goals:
        print(f"| {goal['name']} | {goal['value']:.3f} | {goal['target']} | {goal['met']} |")
    print(f"\nBlocked = time inside save(); the caller calls wait_released() before modifying "
          f"the tensors. With no work to overlap, that wait ends {goal_row['released_s']:.3f} s "
          f"after save() began ({100 * no_overlap:.1f}% of the write time; information).")

    if args.json:
        machine = {
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": sys.version.split()[0],
            "platform": platform.platform(),
        }
        with open(args.json, "w") as file:
            json.dump({"benchmark": "async_io", "machine": machine, "rows": rows,
                       "goals": goals, "goal_row": OURS_BG,
                       "released_fraction_no_overlap": no_overlap}, file, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
