"""Checkpoint save/load: Colossal (sync and async) vs torch.distributed.checkpoint, one run.

A ~200M-parameter model (a stack of 4096x4096 linears) with AdamW state is saved and loaded
at world 2 on gloo CPU processes. The disk's write bandwidth (both ranks writing with fsync,
in parallel) is measured in the same run. Rows: seconds, GB/s, and for async saves the time
the training thread was blocked. Our async save is followed by a training step (forward and
backward of ``--batch`` rows, then ``optimizer.step()``): its snapshot runs in the background
while the step computes, and the step's optimizer update waits for it (the fence). "blocked"
is the save call plus that wait; "compute_s" shows how much the step itself slowed down next
to the same step alone. DCP's ``async_save`` row counts only its call, which copies the state.

    python benchmarks/checkpoint.py [--quick] [--world 2] [--batch 64] [--dir /tmp/x]

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
from bench_common import goal, markdown_table, write_json
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


def run(
    rank: int, world: int, layers: int, width: int, batch: int, root: str
) -> list[dict[str, Any]]:
    model, optimizer = build(layers, width)
    shard_mb = 32 if width <= 2048 else 256  # several shards per rank
    total = sum(p.numel() * 4 * 3 for p in model.parameters())  # params + 2 Adam states
    rows: list[dict[str, Any]] = []
    # 1. disk bandwidth: every rank writes its share of the checkpoint in parallel
    secs = disk_write(os.path.join(root, f"disk{rank}.bin"), total // world)
    rows.append({"method": "disk write (fsync, all ranks)", "save_s": secs})
    # 2. ours
    booster = Booster(plugin=TorchDDPPlugin())
    bmodel, bopt, *_ = booster.boost(model, optimizer)
    ours = os.path.join(root, "ours")

    def save_ours(use_async: bool) -> None:
        booster.save_model(
            bmodel, f"{ours}/model", shard=True, size_per_shard=shard_mb, use_async=use_async
        )
        booster.save_optimizer(
            bopt, f"{ours}/optim", shard=True, size_per_shard=shard_mb, use_async=use_async
        )

    sync_s = timed(lambda: save_ours(False))
    load_s = timed(
        lambda: (
            booster.load_model(bmodel, f"{ours}/model"),
            booster.load_optimizer(bopt, f"{ours}/optim"),
        )
    )
    rows.append({"method": "colossal save (sync)", "save_s": sync_s, "load_s": load_s})
    # Async: save, then the next training step runs while the snapshot is taken; its
    # optimizer.step() must wait for the snapshot (the fence, timed here explicitly). The
    # training thread is blocked for the save call plus that wait.
    inner = bmodel.unwrap()
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
    # 3. torch.distributed.checkpoint
    theirs = os.path.join(root, "dcp")

    def state() -> dict[str, Any]:
        msd, osd = get_state_dict(inner, optimizer)
        return {"model": msd, "optim": osd}

    def save_dcp() -> None:
        dcp.save(state(), checkpoint_id=f"{theirs}/a")

    def load_dcp() -> None:
        sd = state()
        dcp.load(sd, checkpoint_id=f"{theirs}/a")
        set_state_dict(inner, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    dcp_s = timed(save_dcp)
    dcp_load = timed(load_dcp)
    rows.append({"method": "DCP save", "save_s": dcp_s, "load_s": dcp_load})
    group = dist.new_group(backend="gloo")
    dist.barrier()
    t0 = time.perf_counter()
    future = dcp.async_save(state(), checkpoint_id=f"{theirs}/b", process_group=group)
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
    args = parser.parse_args(argv)
    layers, width = (4, 2048) if args.quick else (12, 4096)
    root = tempfile.mkdtemp(prefix="colossal_ckpt_bench_", dir=args.dir)
    try:
        rows = spawn(run, args.world, args=(layers, width, args.batch, root), timeout=1800)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    params = layers * width * width
    print(f"{params / 1e6:.0f}M params + AdamW state, world {args.world}\n")
    print(
        markdown_table(
            rows, ["method", "GB", "save_s", "save_GB_s", "blocked_s", "compute_s", "load_s"]
        )
    )
    by = {r["method"]: r for r in rows}
    disk = by["disk write (fsync, all ranks)"]["save_GB_s"]
    ours = by["colossal save (sync)"]
    ours_async = by["colossal save (async, repeat)"]
    dcp_row = by["DCP save"]
    goals = [
        goal(
            "sync save / disk bandwidth",
            ours["save_GB_s"] / disk,
            ">= 0.9",
            ours["save_GB_s"] >= 0.9 * disk,
        ),
        goal(
            "sync save / DCP save throughput",
            ours["save_GB_s"] / dcp_row["save_GB_s"],
            ">= 1.0",
            ours["save_GB_s"] >= dcp_row["save_GB_s"],
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
