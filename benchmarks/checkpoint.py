"""Checkpoint save/load: Colossal (sync and async) vs torch.distributed.checkpoint, one run.

A ~200M-parameter model (a stack of 4096x4096 linears) with AdamW state is saved and loaded at
world 2 on gloo CPU processes. The disk's write bandwidth (both ranks writing with fsync, in
parallel), our sync save and DCP's save are timed in ``--rounds`` rounds (rotating order,
after an untimed warm-up round), each load right after its save; every write starts on blocks
the previous one freed (:func:`clear_directory`). Rows: median seconds (with min and max),
GB/s, the median over rounds of the disk's and DCP's time over ours in the same round
(``vs_*_paired``), loads from the disk (the saved files dropped from the page cache first,
:func:`evict_from_cache`), and for async saves the time the training thread was blocked. Our
async save is followed by a training step (forward and backward of ``--batch`` rows, then
``optimizer.step()``): its snapshot runs in the background while the step computes, and the
step's optimizer update waits for it (the fence). "blocked" is the save call plus that wait;
"compute_s" shows how much the step itself slowed down next to the same step alone. DCP's
``async_save`` row counts only its call, which copies the state. Our sync save writes DDP's
replicated state in place (every rank its share of the tensors, straight into the final
files); ``--staging`` also times the earlier way in the same rounds (each file written whole
by one rank with ``O_DIRECT``, the ranks meeting in a staging folder:
``CheckpointIO(write_in_place=False)``).

    python benchmarks/checkpoint.py [--quick] [--world 2] [--rounds 3] [--batch 64] [--dir /tmp/x]
                                    [--staging]

Goals (issue 7): sync save throughput >= 0.9x disk write bandwidth and >= DCP's; async save
blocks the caller for <= 10% of the sync save time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from bench_common import goal, markdown_table, paired_median, spread, write_json
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from colossal.booster import Booster
from colossal.booster.plugin import TorchDDPPlugin
from colossal.core.testing import spawn


def build(layers: int, width: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # allocate exp_avg / exp_avg_sq
    optimizer.zero_grad()
    return model, optimizer


def timed(fn: Any) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def disk_write(path: str, nbytes: int, keep: bool = False) -> float:
    """Seconds to write ``nbytes`` from memory to ``path`` with fsync (this rank).

    The file is deleted afterwards (untimed) unless ``keep``.
    """
    data = torch.ones(nbytes // 4, dtype=torch.float32).view(torch.uint8).numpy()
    chunk = 64 * 1024 * 1024

    def write() -> None:
        with open(path, "wb", buffering=0) as fh:
            for i in range(0, len(data), chunk):
                fh.write(memoryview(data[i : i + chunk]))
            os.fsync(fh.fileno())

    seconds = timed(write)
    if not keep:
        os.remove(path)
    return seconds


ROUNDS = 3


def clear_directory(rank: int, here: str) -> None:
    """Delete what ``here`` holds (keeping ``here``), then let the deletion settle (untimed).

    Collective. A write onto blocks a deleted file has just freed runs about 3x faster on
    these machines' virtual disks than one onto blocks never written before, whoever
    writes: clearing between measured writes gives each the same kind of blocks.
    """
    dist.barrier()
    if rank == 0:
        for name in os.listdir(here):
            entry = os.path.join(here, name)
            if os.path.isdir(entry):
                shutil.rmtree(entry, ignore_errors=True)
            else:
                os.remove(entry)
    os.sync()
    dist.barrier()


def evict_from_cache(rank: int, here: str) -> None:
    """Drop the page cache of every file under ``here`` (collective; untimed).

    A load timed right after its save would read the bytes the save left in memory; a job
    that restarts reads them from the disk. Written files are clean after their fsync, so
    ``POSIX_FADV_DONTNEED`` drops them.
    """
    dist.barrier()
    if rank == 0:
        for folder, _, files in os.walk(here):
            for name in files:
                fd = os.open(os.path.join(folder, name), os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
    dist.barrier()


def run(
    rank: int, world: int, layers: int, width: int, batch: int, root: str, rounds: int,
    staging: bool = False,
) -> list[dict[str, Any]]:
    model, optimizer = build(layers, width)
    shard_mb = 32 if width <= 2048 else 256  # several shards per rank
    total = sum(p.numel() * 4 * 3 for p in model.parameters())  # params + 2 Adam states
    here = os.path.join(root, "work")
    os.makedirs(here, exist_ok=True)
    booster = Booster(plugin=TorchDDPPlugin())
    bmodel, bopt, *_ = booster.boost(model, optimizer)
    inner = bmodel.unwrap()

    def save_ours(use_async: bool, in_place: bool = True) -> None:
        booster.checkpoint_io.write_in_place = in_place
        booster.save_model(
            bmodel, f"{here}/model", shard=True, size_per_shard=shard_mb, use_async=use_async
        )
        booster.save_optimizer(
            bopt, f"{here}/optim", shard=True, size_per_shard=shard_mb, use_async=use_async
        )

    def load_ours() -> None:
        booster.load_model(bmodel, f"{here}/model")
        booster.load_optimizer(bopt, f"{here}/optim")

    def state() -> dict[str, Any]:
        msd, osd = get_state_dict(inner, optimizer)
        return {"model": msd, "optim": osd}

    def save_dcp() -> None:
        dcp.save(state(), checkpoint_id=f"{here}/dcp")

    def load_dcp() -> None:
        sd = state()
        dcp.load(sd, checkpoint_id=f"{here}/dcp")
        set_state_dict(inner, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    # 1. Rounds of the three writers in rotating order, each write (and its load) on blocks
    # the previous write freed; round -1 warms up, untimed.
    times: dict[str, list[float]] = {k: [] for k in ("disk", "ours", "ours_load", "dcp",
                                                      "dcp_load", "staging", "staging_load")}
    kinds = ["disk", "ours", "dcp"] + (["staging"] if staging else [])
    for i in range(-1, rounds):
        for kind in kinds[i % len(kinds):] + kinds[: i % len(kinds)]:
            if kind == "disk":  # every rank writes its share of the checkpoint in parallel
                spent = {"disk": disk_write(os.path.join(here, f"disk{rank}.bin"),
                                            total // world, keep=True)}
            elif kind in ("ours", "staging"):
                in_place = kind == "ours"
                spent = {kind: timed(lambda in_place=in_place: save_ours(False, in_place))}
                evict_from_cache(rank, here)
                spent[f"{kind}_load"] = timed(load_ours)
            else:
                spent = {"dcp": timed(save_dcp)}
                evict_from_cache(rank, here)
                spent["dcp_load"] = timed(load_dcp)
            if i >= 0:
                for key, seconds in spent.items():
                    times[key].append(seconds)
            clear_directory(rank, here)
    rows: list[dict[str, Any]] = [
        {"method": "disk write (fsync, all ranks)", **spread("save", times["disk"])},
        {"method": "colossal save (sync)", **spread("save", times["ours"]),
         **spread("load", times["ours_load"]),
         "vs_disk_paired": paired_median(times["disk"], times["ours"]),
         "vs_dcp_paired": paired_median(times["dcp"], times["ours"])},
    ]
    if staging:
        rows.append({"method": "colossal save (sync, staging)", **spread("save", times["staging"]),
                     **spread("load", times["staging_load"]),
                     "vs_disk_paired": paired_median(times["disk"], times["staging"]),
                     "vs_dcp_paired": paired_median(times["dcp"], times["staging"])})
        rows[1]["vs_staging_paired"] = paired_median(times["staging"], times["ours"])
    # 2. Async: save, then the next training step runs while the snapshot is taken; its
    # optimizer.step() must wait for the snapshot (the fence, timed here explicitly). The
    # training thread is blocked for the save call plus that wait.
    x = torch.randn(batch, width)

    def forward_backward() -> None:
        inner(x).float().square().mean().backward()  # no DDP all-reduce: compute only

    compute_s = timed(forward_backward)
    rows.append({"method": f"forward+backward alone (batch {batch})", "compute_s": compute_s})
    for label in ("first", "repeat"):  # the repeat reuses the writer's snapshot buffers
        call_s = timed(lambda: save_ours(True))
        t0 = time.perf_counter()
        forward_backward()
        busy_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        booster.wait_async_snapshots()
        fence_s = time.perf_counter() - t0
        bopt.step()
        bopt.zero_grad()
        t0 = time.perf_counter()
        booster.wait_async_saves()
        rows.append(
            {
                "method": f"colossal save (async, {label})",
                "save_s": call_s + busy_s + fence_s + time.perf_counter() - t0,
                "blocked_s": call_s + fence_s,
                "compute_s": busy_s,
            }
        )
        clear_directory(rank, here)
    # 3. torch.distributed.checkpoint
    rows.append({"method": "DCP save", **spread("save", times["dcp"]),
                 **spread("load", times["dcp_load"])})
    group = dist.new_group(backend="gloo")
    dist.barrier()
    t0 = time.perf_counter()
    future = dcp.async_save(state(), checkpoint_id=f"{here}/dcp_async", process_group=group)
    blocked = time.perf_counter() - t0
    future.result()
    total_s = time.perf_counter() - t0
    dist.barrier()
    rows.append({"method": "DCP async_save", "save_s": total_s, "blocked_s": blocked})
    for row in rows:
        if "save_s" in row:
            row["GB"] = total / 1e9
            row["save_GB_s"] = total / 1e9 / row["save_s"]
    booster.checkpoint_io.saver.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="~17M params")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--batch", type=int, default=64, help="rows of the training step run after async saves"
    )
    parser.add_argument("--rounds", type=int, default=ROUNDS,
                        help="timed rounds of disk write, our save and DCP's (rotating order)")
    parser.add_argument("--staging", action="store_true",
                        help="also time sync saves through the staging folder "
                        "(write_in_place=False) in the same rounds")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        raise ValueError(f"--rounds={args.rounds} must be >= 1")
    layers, width = (4, 2048) if args.quick else (12, 4096)
    root = tempfile.mkdtemp(prefix="colossal_ckpt_bench_", dir=args.dir)
    try:
        rows = spawn(run, args.world, args=(layers, width, args.batch, root, args.rounds,
                                            args.staging), timeout=1800)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    params = layers * width * width
    print(f"{params / 1e6:.0f}M params + AdamW state, world {args.world}\n")
    print(
        markdown_table(
            rows, ["method", "GB", "save_s", "save_min_s", "save_max_s", "save_GB_s",
                   "blocked_s", "compute_s", "load_s", "vs_disk_paired", "vs_dcp_paired",
                   *(["vs_staging_paired"] if args.staging else [])]
        )
    )
    by = {r["method"]: r for r in rows}
    ours = by["colossal save (sync)"]
    ours_async = by["colossal save (async, repeat)"]
    goals = [
        goal(
            "sync save / disk bandwidth (median of per-round pairs)",
            ours["vs_disk_paired"],
            ">= 0.9",
            ours["vs_disk_paired"] >= 0.9,
        ),
        goal(
            "sync save / DCP save throughput (median of per-round pairs)",
            ours["vs_dcp_paired"],
            ">= 1.0",
            ours["vs_dcp_paired"] >= 1.0,
        ),
        goal(
            "async blocked / sync save time",
            ours_async["blocked_s"] / ours["save_s"],
            "<= 0.10",
            ours_async["blocked_s"] <= 0.10 * ours["save_s"],
        ),
    ]
    print()
    for g in goals:
        print(
            f"- {g['name']}: {g['value']:.2f} (target {g['target']}) "
            f"{'met' if g['met'] else 'NOT met'}"
        )
    write_json(args.json, "checkpoint", rows, goals)
    return 0


if __name__ == "__main__":
    sys.exit(main())
