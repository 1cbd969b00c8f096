"""Where a training step's time goes: DDP, FSDP2 and Gemini phase by phase, for ``gemini.py``.

On spawned gloo ranks (one thread each) every configuration runs warm-up steps, then
``--steps`` steps, alternating, each split into zero_grad / forward / backward / optimizer
step, timed in wall and CPU (``time.process_time``) per phase. Rank 0 then profiles one
more step of each with ``torch.profiler`` (operator table) and, with ``--cprofile``, with
cProfile (Python functions of colossal.gemini by own time: the hook overhead).

    python benchmarks/_gemini_profile.py [--world 2] [--model-size medium] [--steps 3]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import logging
import pstats
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from _gemini_configs import Run, build
from bench_common import markdown_table
from bench_gpt import GPTConfig, lm_loss, random_batch

from colossal.core.testing import spawn

logger = logging.getLogger(__name__)

PHASES = ("zero_grad", "forward", "backward", "step")


def _phased_step(run: Run, data: torch.Tensor) -> dict[str, tuple[float, float]]:
    """One step; (wall, cpu) seconds of each phase."""
    out: dict[str, tuple[float, float]] = {}

    def mark(name: str, w0: float, c0: float) -> tuple[float, float]:
        w, c = time.perf_counter(), time.process_time()
        out[name] = (w - w0, c - c0)
        return w, c

    w, c = time.perf_counter(), time.process_time()
    run.optim.zero_grad()
    w, c = mark("zero_grad", w, c)
    loss = lm_loss(run.module, data)
    w, c = mark("forward", w, c)
    if run.gemini:
        run.optim.backward(loss)
    else:
        loss.backward()
    w, c = mark("backward", w, c)
    run.optim.step()
    mark("step", w, c)
    return out


def _run(
    rank: int, world: int, configs: list[str], size: str, batch: int, steps: int, cprof: bool
) -> dict[str, Any]:
    torch.set_num_threads(1)
    cfg = GPTConfig.preset(size)
    from gemini import chunk_size_for

    chunk_size = chunk_size_for(size, world, 8.0, 2.0)
    runs = {c: build(c, cfg, chunk_size, random_batch(cfg, batch, rank)) for c in configs}
    phases: dict[str, list[dict[str, tuple[float, float]]]] = {c: [] for c in configs}
    for step in range(steps + 1):
        data = random_batch(cfg, batch, seed=1000 * step + rank)
        for config, run in runs.items():
            dist.barrier()
            got = _phased_step(run, data)
            if step:
                phases[config].append(got)
    out: dict[str, Any] = {"phases": phases, "profiles": {}, "cprofile": {}}
    data = random_batch(cfg, batch, seed=7 + rank)
    for config, run in runs.items():
        dist.barrier()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            _phased_step(run, data)
        if rank == 0:
            out["profiles"][config] = prof.key_averages().table(
                sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=48
            )
        if cprof:
            dist.barrier()
            profiler = cProfile.Profile()
            profiler.enable()
            _phased_step(run, data)
            profiler.disable()
            if rank == 0:
                text = io.StringIO()
                stats = pstats.Stats(profiler, stream=text)
                stats.sort_stats("tottime").print_stats(25)
                out["cprofile"][config] = text.getvalue()
    return out


def main(argv: list[str] | None = None) -> int:
    """Print per-phase medians (wall and CPU, rank 0 and summed) and the profiles."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--model-size", default="medium", choices=["tiny", "small", "medium"])
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--configs", nargs="+", default=["ddp", "fsdp2_bf16", "gemini_static_bf16"])
    parser.add_argument("--cprofile", action="store_true")
    parser.add_argument("--no-tables", action="store_true", help="phases only")
    args = parser.parse_args(argv)
    per_rank = spawn(
        _run,
        args.world,
        args=(args.configs, args.model_size, args.batch_size, args.steps, args.cprofile),
        timeout=3600,
    )
    rows = []
    for config in args.configs:
        row: dict[str, Any] = {"config": config}
        total_w = total_c = 0.0
        for phase in PHASES:
            wall = statistics.median(
                max(r["phases"][config][i][phase][0] for r in per_rank) for i in range(args.steps)
            )
            cpu = statistics.median(
                sum(r["phases"][config][i][phase][1] for r in per_rank) for i in range(args.steps)
            )
            row[f"{phase}_ms"] = wall * 1e3
            row[f"{phase}_cpu_ms"] = cpu * 1e3
            total_w += wall
            total_c += cpu
        row["total_ms"] = total_w * 1e3
        row["total_cpu_ms"] = total_c * 1e3
        rows.append(row)
    cols = ["config"] + [f"{p}_ms" for p in PHASES] + ["total_ms"]
    cols += [f"{p}_cpu_ms" for p in PHASES] + ["total_cpu_ms"]
    print(
        f"world {args.world}, {args.model_size}, batch {args.batch_size}/rank, "
        f"medians of {args.steps} steps (wall: slowest rank; cpu: summed over ranks)"
    )
    print(markdown_table(rows, cols))
    if not args.no_tables:
        for config, table in per_rank[0]["profiles"].items():
            print(f"\n### torch.profiler, rank 0, {config}\n{table}")
        for config, text in per_rank[0]["cprofile"].items():
            print(f"\n### cProfile, rank 0, {config}\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
