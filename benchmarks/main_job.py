"""The main job (``colossal run`` of the GPT example, ZeRO-2) against a plain PyTorch loop.

Trains the example's character-level ``GPT2LMHeadModel`` (4 layers, 4 heads, 128 wide,
block 64, global batch 12 x 64) under each configuration, one run per configuration per
round, the order rotating every round so that load from other processes and the machine's
warm-up hit all alike:

- ``plain``: a single-process PyTorch loop with 2 threads, written as a plain user would
  (``_main_job_plain.py``: fused ``torch.optim.AdamW``, ``LambdaLR``, ``clip_grad_norm_``);
- ``colossal_zero2``: the main job, ``colossal run --nproc_per_node 2 examples/train_gpt.py
  --plugin zero2`` at the example's defaults (fused kernels on), one thread per rank;
- ``colossal_zero2_unfused``: the same with ``--no-fused-kernels`` (what the kernels bring);
- ``plain_half_1thread``: the plain loop on half the batch with one thread, i.e. one rank's
  share of the work: the compute floor of a 2-rank run (its validation loss is reported but
  is not comparable, it sees half the data).

Per run, the per-iteration time is the median of the iteration times (wall ms, evaluation
excluded) after dropping the first 10% (warm-up). Per configuration the table gives the
median over the rounds with min and max, its ratio to ``plain``'s median, and the median
final validation loss.

    python benchmarks/main_job.py [--quick] [--iters 2000] [--rounds 3] [--configs ...]
        [--json out.json]

Goals (issue 17), stated as met only on the medians: the main job's per-iteration time
<= 0.85x the plain loop's, and its final validation loss within 0.03 of the plain loop's
(meaningful at the full 2000 iterations, the main job's setting; ``--quick`` trains 150).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from bench_common import goal, machine, markdown_table, write_json

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
EXAMPLE = os.path.join(REPO, "examples", "train_gpt.py")
PLAIN = os.path.join(HERE, "_main_job_plain.py")

CONFIGS = ("plain", "colossal_zero2", "colossal_zero2_unfused", "plain_half_1thread")
BASELINE = "plain"
MAIN = "colossal_zero2"
TIME_TARGET = 0.85
VAL_TOLERANCE = 0.03
WARMUP_SHARE = 0.1


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launcher(port: int) -> list[str]:
    """``colossal run`` (through this interpreter), or torchrun when the CLI is missing."""
    if importlib.util.find_spec("colossal.cli") is not None:
        return [sys.executable, "-m", "colossal.cli", "run", "--nproc_per_node", "2",
                "--master_port", str(port)]  # fmt: skip
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
            f"--master_port={port}"]  # fmt: skip


def command(config: str, iters: int, eval_iters: int, out: str, metrics: str) -> list[str]:
    """The argv of one run of ``config``; it writes its metrics JSON to ``metrics``."""
    if config.startswith("plain"):
        threads, batch = (1, 6) if config == "plain_half_1thread" else (2, 12)
        return [sys.executable, PLAIN, "--iters", str(iters), "--threads", str(threads),
                "--batch-size", str(batch), "--eval-iters", str(eval_iters),
                "--metrics-json", metrics]  # fmt: skip
    argv = [*_launcher(_free_port()), EXAMPLE, "--plugin", "zero2", "--iters", str(iters),
            "--no-progress", "--eval-interval", str(iters), "--eval-iters", str(eval_iters),
            "--out", out, "--metrics-json", metrics]  # fmt: skip
    if config == "colossal_zero2_unfused":
        argv.append("--no-fused-kernels")
    return argv


def _env(config: str) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "2" if config == "plain" else "1"
    return env


def run_once(config: str, iters: int, eval_iters: int, timeout: float) -> dict[str, Any]:
    """One run: ``{"iter_ms", "final_val", "wall_s"}`` or ``{"error"}``."""
    out = tempfile.mkdtemp(prefix=f"main_job_{config}_")
    metrics = os.path.join(out, "metrics.json")
    started = time.perf_counter()
    try:
        proc = subprocess.run(
            command(config, iters, eval_iters, out, metrics),
            cwd=REPO,
            env=_env(config),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        wall = time.perf_counter() - started
        if proc.returncode != 0 or not os.path.isfile(metrics):
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
            print("\n".join(tail), file=sys.stderr, flush=True)
            last = tail[-1] if tail else ""
            return {"error": f"exit {proc.returncode}: {last[:140]}", "wall_s": wall}
        with open(metrics, encoding="utf-8") as fh:
            data = json.load(fh)
        times = data["iter_ms"][int(len(data["iter_ms"]) * WARMUP_SHARE) :]
        if not times:
            return {"error": "no timed iterations", "wall_s": wall}
        return {
            "iter_ms": statistics.median(times),
            "final_val": float(data["final_val"]),
            "wall_s": wall,
        }
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s", "wall_s": timeout}
    except Exception as exc:  # noqa: BLE001 - a failing run is a row, the benchmark goes on
        return {"error": f"{type(exc).__name__}: {str(exc)[:140]}"}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _row(config: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if "error" not in r]
    errors = sorted({r["error"] for r in runs if "error" in r})
    row: dict[str, Any] = {"config": config, "runs": f"{len(ok)}/{len(runs)}"}
    if ok:
        ms = [r["iter_ms"] for r in ok]
        vals = [r["final_val"] for r in ok]
        row.update(
            iter_ms=statistics.median(ms),
            min_ms=min(ms),
            max_ms=max(ms),
            final_val=statistics.median(vals),
            val_min=min(vals),
            val_max=max(vals),
            wall_s=statistics.median(r["wall_s"] for r in ok),
            per_round_ms=ms,
            per_round_val=vals,
        )
    row["status"] = "ok" if not errors else "; ".join(errors)
    return row


def _goals(by_config: dict[str, dict[str, Any]], iters: int) -> list[dict[str, Any]]:
    base, main = by_config.get(BASELINE, {}), by_config.get(MAIN, {})
    goals: list[dict[str, Any]] = []
    if "iter_ms" in base and "iter_ms" in main:
        ratio = main["time_vs_plain"]
        goals.append(
            goal(
                f"{MAIN} per-iteration time vs plain loop (median)",
                ratio,
                f"<= {TIME_TARGET}",
                ratio <= TIME_TARGET,
            )
        )
        diff = main["final_val"] - base["final_val"]
        goals.append(
            goal(
                f"{MAIN} final val loss within {VAL_TOLERANCE} of the plain loop's "
                f"(median, {iters} iters)",
                diff,
                f"-{VAL_TOLERANCE}..{VAL_TOLERANCE}",
                abs(diff) <= VAL_TOLERANCE,
            )
        )
    return goals


def main(argv: list[str] | None = None) -> int:
    """Run the configurations in rotating rounds, print the table and the goals."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="150 iterations, 5 eval batches")
    parser.add_argument("--iters", type=int, default=None, help="default 2000 (quick 150)")
    parser.add_argument("--rounds", type=int, default=3, help="runs per configuration")
    parser.add_argument("--eval-iters", type=int, default=None, help="default 20 (quick 5)")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--timeout", type=float, default=None, help="seconds per run")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    iters = args.iters or (150 if args.quick else 2000)
    eval_iters = args.eval_iters or (5 if args.quick else 20)
    timeout = args.timeout or 300 + 0.5 * iters
    if args.rounds < 1:
        raise ValueError(f"--rounds={args.rounds} must be >= 1")
    if args.rounds < 3:
        print(f"note: {args.rounds} round(s); the goals need >= 3", file=sys.stderr)
    configs = list(dict.fromkeys(args.configs))

    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    for r in range(args.rounds):
        shift = r % len(configs)
        for config in configs[shift:] + configs[:shift]:
            result = run_once(config, iters, eval_iters, timeout)
            runs[config].append(result)
            what = result.get("error") or f"{result['iter_ms']:.1f} ms/iter"
            print(
                f"round {r + 1}/{args.rounds} {config}: {what} "
                f"({result.get('wall_s', float('nan')):.0f} s)",
                file=sys.stderr,
                flush=True,
            )

    rows = [_row(c, runs[c]) for c in configs]
    by_config = {row["config"]: row for row in rows}
    base = by_config.get(BASELINE, {})
    for row in rows:
        if "iter_ms" in row and "iter_ms" in base:
            row["time_vs_plain"] = row["iter_ms"] / base["iter_ms"]
    goals = _goals(by_config, iters)
    columns = ["config", "runs", "iter_ms", "min_ms", "max_ms", "time_vs_plain", "final_val",
               "val_min", "val_max", "wall_s", "status"]  # fmt: skip
    print(f"{iters} iterations, {args.rounds} rounds; per-iteration ms: median over rounds "
          f"(min, max) of each run's median after {WARMUP_SHARE:.0%} warm-up")  # fmt: skip
    print(markdown_table(rows, columns))
    print()
    print(markdown_table(goals, ["name", "value", "target", "met"]))
    print(f"\nmachine: {machine()}")
    write_json(args.json, "main_job", rows, goals)
    return 0


if __name__ == "__main__":
    sys.exit(main())
